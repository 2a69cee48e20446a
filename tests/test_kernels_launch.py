"""Launch choices for the kernels: tile-shape policy (tuning.py: the offline table, forced configs) and launch
mechanics (launch.py: grids, direct launches)."""

import functools
import json
import re

import pytest
import torch
import triton
import triton.language as tl
from attention_checks import assert_matches_reference

from flashformer.kernels import flash_attn_func, interface, launch, settings, tuning


@pytest.mark.parametrize("window_right,expected", [(0, "causal"), (4, "causal"), (-1, "full")])
def test_windows_take_the_tiles_of_their_masks_family(window_right, expected):
    assert tuning.table_mask(window_right) == expected


def test_only_deterministic_false_takes_the_unordered_gluon_backward():
    # deterministic=True must stay bit-identical: the arrival-order dQ reduction is never its form
    forms = {(pad, seqlen, left, right, det): tuning.gluon_backward_form(pad, seqlen, left, right, det)
             for pad in (64, 128, 256) for seqlen in (1, 1024, 2048, 8192, 1 << 20)
             for left, right in ((-1, -1), (-1, 0), (64, 0), (-1, 16)) for det in (True, False)}
    assert {form for (*_, det), form in forms.items() if det} == {"two-kernel"}
    unordered = {key[:4] for key, form in forms.items() if form == "fused-split"}
    assert unordered and all(pad == 128 and left < 0 and right <= 0 for pad, _, left, right in unordered)
    assert tuning.gluon_backward_form(128, 1 << 20, -1, -1, False) == "fused-split"


def test_a_misspelt_gluon_backward_form_is_refused_by_name():
    assert tuning.checked_gluon_form(None) is None and tuning.checked_gluon_form("fused-split") == "fused-split"
    with pytest.raises(ValueError, match=r"gluon_form must be None or one of .*got 'fused-splt'"):
        tuning.checked_gluon_form("fused-splt")


def test_deterministic_false_keeps_the_reduced_dq_form_off_the_gpu_and_in_the_interpreter():
    assert tuning.tl_reduced_dq_pays(torch.device("cpu"), 64) and tuning.tl_reduced_dq_pays(torch.device("cpu"), 128)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the two-kernel choice for deterministic=False is the H200's measurement")
def test_deterministic_false_at_head_dim_64_on_hopper_takes_the_bit_identical_two_kernels():
    q, k, v = (torch.randn(2, 1000, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    grads = [torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=det), (q, k, v), grad_out)
             for det in (False, False, True)]
    assert not tuning.tl_reduced_dq_pays(q.device, 64)
    for grad in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grad))


@pytest.mark.skipif(not torch.cuda.is_available() or not interface.hopper_gluon_available(0),
                    reason="the Gluon kernels compile on an sm_90 GPU")
def test_a_new_length_of_another_divisibility_compiles_no_gluon_kernel_again():
    from flashformer.kernels import flash_bwd_dq_hopper, flash_bwd_hopper, flash_fwd_hopper

    kernels = (flash_fwd_hopper._attn_fwd_hopper_kernel, flash_bwd_hopper._attn_bwd_dkdv_hopper_kernel,
               flash_bwd_dq_hopper._attn_bwd_dq_hopper_kernel)

    def compiled():
        return [sum(len(cache[0]) for cache in kernel.device_caches.values()) for kernel in kernels]

    def step(seqlen):
        q, k, v = (torch.randn(2, seqlen, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), torch.randn_like(q))

    step(1001)
    before = compiled()
    assert all(before)
    for seqlen in (1008, 1013, 1016):  # lengths and lse strides divisible by 16 or not; the 1024 bucket's tiles
        step(seqlen)
    assert compiled() == before


def test_the_interpreter_names_the_numpy_pin_it_needs():
    with pytest.raises(RuntimeError, match=r'TRITON_INTERPRET=1 with triton 3\.6\.0 needs numpy<2\.4 \(found 2\.4\.1\)'):
        settings.check_interpreter_numpy("3.6.0", "2.4.1")
    settings.check_interpreter_numpy("3.6.0", "2.3.5")
    settings.check_interpreter_numpy("3.9.0", "2.4.6")


def test_measured_config_takes_the_nearest_bucket_within_an_octave(tmp_path, monkeypatch):
    table = {"Some GPU": {"fwd": {"d128-causal": {"512": [64, 32, 4, 2], "16384": [128, 64, 8, 3]},
                                  "d64-full": {"4096": [128, 64, 8, 2, 128]}},
                          "bwd_dq": {"d64-full": {"1024": [128, 64, 8, 3]}}}}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "TUNED_CONFIGS_PATH", str(path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    tuning._measured_table.cache_clear()
    try:
        gpu = torch.device("cuda", 0)
        assert tuning.measured_config(gpu, "fwd", 128, True, 1024)["BLOCK_M"] == 64  # log2 distance 1 vs 4
        assert tuning.measured_config(gpu, "fwd", 128, True, 8192)["BLOCK_M"] == 128
        assert tuning.measured_config(gpu, "fwd", 128, True, 65536) == {  # past the longest, >= 16k
            "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        assert tuning.measured_config(gpu, "fwd", 128, True, 2048) is None  # 2 octaves from 512 and 16k
        assert tuning.measured_config(gpu, "fwd", 64, False, 4096) == {  # a pick that caps registers
            "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128}
        assert tuning.measured_config(gpu, "bwd_dq", 64, False, 2048) is not None
        assert tuning.measured_config(gpu, "bwd_dq", 64, False, 4096) is None  # a table cut short at 1k
        assert tuning.measured_config(gpu, "fwd", 128, False, 1024) is None  # not measured: autotune
        assert tuning.measured_config(gpu, "bwd_dq", 128, True, 1024) is None
        assert tuning.measured_config(gpu, "fwd", 64, True, 1024) is None
    finally:
        tuning._measured_table.cache_clear()


def test_a_gpu_without_its_own_table_takes_one_of_its_compute_capability():
    h200 = {"capability": "9.0", "fwd": {"d64-full": {"4096": [128, 64, 8, 2]}}}
    a100 = {"capability": "8.0", "fwd": {"d64-full": {"4096": [64, 32, 4, 2]}}}
    tables = {"NVIDIA A100": a100, "NVIDIA H200": h200}
    assert tuning.table_for(tables, "NVIDIA H100 80GB HBM3", "9.0") == h200
    assert tuning.table_for(tables, "NVIDIA A100", "8.0") == a100
    assert tuning.table_for(tables, "NVIDIA L4", "8.9") == {}  # no table of its kind: the autotuner
    assert tuning.sibling_table(tables, "NVIDIA H100 PCIe", "9.0") == ("NVIDIA H200", h200)
    assert tuning.sibling_table(tables, "NVIDIA H200", "9.0") == (None, {})  # never its own
    assert tuning.config_in_table(tuning.table_for(tables, "NVIDIA H100 PCIe", "9.0"), "fwd", 64, False, 4096) == {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


def test_a_gpus_own_entries_add_to_its_capabilitys_table_entry_by_entry():
    # A sweep cut short (one head_dim, a few lengths) must not take the rest of the fallback away.
    h200 = {"capability": "9.0",
            "fwd": {"d64-full": {"1024": [128, 64, 8, 2], "4096": [128, 64, 8, 2]},
                    "d256-full": {"4096": [64, 64, 8, 2]}},
            "bwd_dq": {"d64-full": {"4096": [64, 64, 4, 3]}}}
    h100 = {"capability": "9.0", "fwd": {"d64-full": {"4096": [64, 64, 4, 3]}, "d128-causal": {"1024": [64, 32, 4, 2]}}}
    table = tuning.table_for({"NVIDIA H200": h200, "NVIDIA H100 80GB HBM3": h100}, "NVIDIA H100 80GB HBM3", "9.0")
    assert table["fwd"] == {"d64-full": {"1024": [128, 64, 8, 2], "4096": [64, 64, 4, 3]},
                            "d256-full": {"4096": [64, 64, 8, 2]}, "d128-causal": {"1024": [64, 32, 4, 2]}}
    assert table["bwd_dq"] == h200["bwd_dq"] and table["capability"] == "9.0"
    assert tuning.config_in_table(table, "fwd", 64, False, 4096)["BLOCK_M"] == 64  # its own measurement
    assert tuning.config_in_table(table, "fwd", 256, False, 4096)["BLOCK_M"] == 64  # the H200's, kept
    assert h200["fwd"]["d64-full"]["4096"] == [128, 64, 8, 2]  # the tables read are left as they were


def test_the_shipped_table_records_each_gpus_compute_capability():
    with open(tuning.TUNED_CONFIGS_PATH) as f:
        tables = json.load(f)
    assert tables and all(re.fullmatch(r"\d+\.\d+", table.get("capability", "")) for table in tables.values())


@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128},  # the capped candidate
])
def test_forced_configs_compute_the_same_attention(config, device, triton_path, monkeypatch):
    """Tile shapes other than the interpreter's defaults (as a tuning run forces them) stay exact."""
    monkeypatch.setattr(tuning, "FORCED_CONFIGS", {kind: config for kind in ("fwd", "bwd_dkdv", "bwd_dq")})
    q, k, v, grad_out = (torch.randn(1, 77, 2, 32, device=device, dtype=torch.float16) for _ in range(4))
    assert_matches_reference(flash_attn_func, q, k, v, grad_out, causal=True)


def test_forced_config_overrides_every_other_choice(monkeypatch):
    forced = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}
    monkeypatch.setattr(tuning, "FORCED_CONFIGS", {"bwd_dq": forced})
    assert tuning.pick_kernel(torch.device("cpu"), "bwd_dq", "kernel", "tuned", 64, "causal", 1024) == ("kernel", forced)
    assert tuning.pick_kernel(torch.device("cpu"), "fwd", "kernel", "tuned", 64, "causal", 1024) == (
        "kernel", tuning.INTERPRETER_CONFIGS["fwd"])


def test_grid_gives_heads_and_batch_their_own_dimensions():
    """8196 sequences of 8 heads make 65568 (batch, head) programs, past CUDA's 65535 cap on grid
    dimensions y and z (CUDA rejects such a launch with "invalid argument")."""
    assert launch.tile_grid(128, 128, 0, 8196, 8, is_varlen=False) == (1, 8, 8196)
    assert launch.tile_grid(128, 0, 1000, 8196, 8, is_varlen=True) == (8 + 8196, 8, 1)


def test_a_batch_past_the_grid_cap_names_the_argument(device, triton_path):
    q = torch.randn(launch.MAX_GRID_YZ + 1, 1, 1, 16, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="batch = 65536.*flash_attn_varlen_func"):
        flash_attn_func(q, q, q)


@pytest.mark.parametrize("kind", ["fwd", "bwd_dkdv", "bwd_dq", "bwd_fused"])
def test_head_dim_256_has_its_own_candidates(kind):
    """head_dim 256 autotunes over its own shapes (of the head_dim <= 128 ones only one forward fit its
    shared memory), and those never leak into the smaller head dims' spaces."""
    configs = tuning._gpu_configs(kind)
    wide = [tuning._shape(c) for c in tuning.prune_configs(kind, configs, {"HEAD_DIM_PAD": 256})]
    assert sorted(wide) == sorted(tuning._WIDE_SHAPES[kind])
    default = tuning._default_gpu_config(kind, 256)
    assert (default["BLOCK_M"], default["BLOCK_N"], default["num_warps"], default["num_stages"]) in wide
    for head_dim in (64, 128):
        narrow = [tuning._shape(c) for c in tuning.prune_configs(kind, configs, {"HEAD_DIM_PAD": head_dim})]
        assert narrow and set(narrow) <= set(tuning._SHAPES[kind])


def test_the_paged_forward_never_runs_register_capped():
    """The paged forward's row pointers need ~215 registers at head_dim 128: the capped candidates (128, two
    programs per SM) would spill, so neither the autotuner nor the offline table's pick hands it one."""
    configs = tuning._gpu_configs("fwd")
    dense = tuning.prune_configs("fwd", configs, {"HEAD_DIM_PAD": 128, "IS_PAGED": False})
    paged = tuning.prune_configs("fwd", configs, {"HEAD_DIM_PAD": 128, "IS_PAGED": True})
    assert any(config.maxnreg for config in dense) and paged and not any(config.maxnreg for config in paged)
    capped = tuning.config_from_shape((128, 64, 8, 2, 128))
    assert tuning.row_pointer_config(capped) == tuning.config_from_shape((128, 64, 8, 2))


@pytest.mark.parametrize("kind", ["fwd", "bwd_dkdv", "bwd_dq", "bwd_fused"])
def test_candidates_survive_the_round_trip_to_the_table(kind):
    """A tuning run writes its pick as a table entry and a launch reads it back: the register cap of
    the capped shapes must survive both ways."""
    for config in tuning._gpu_configs(kind):
        shape = tuning._shape(config)
        meta = tuning.config_from_shape(shape)
        assert tuning.shape_of_config(meta) == shape
        assert meta.get("maxnreg") == config.maxnreg
    assert any(config.maxnreg for config in tuning._gpu_configs("fwd"))


class _LauncherAttributes:
    """The attributes of Triton 3.6's CudaLauncher that _DirectLaunch reads (no GPU here to compile one)."""
    global_scratch_size, global_scratch_align, profile_scratch_size, num_ctas = 128, 128, 0, 1
    launch_cooperative_grid = launch_pdl = False

    def launch(self, *args):
        raise AssertionError("not launched in this test")


class _CompiledKernelAttributes:
    def __init__(self, **launcher_attributes):
        self._run = _LauncherAttributes()
        vars(self._run).update(launcher_attributes)

    def _init_handles(self):
        pass


def test_direct_launch_only_where_the_launcher_protocol_is_known(monkeypatch):
    """Triton's C launcher is called directly only for the version whose argument order it follows
    and without profiling scratch; everything else takes the compiled kernel's own launch path."""
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert launch._DirectLaunch(_CompiledKernelAttributes(), ()).c_launch is not None
    assert launch._DirectLaunch(_CompiledKernelAttributes(profile_scratch_size=64), ()).c_launch is None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert launch._DirectLaunch(_CompiledKernelAttributes(), ()).c_launch is None


def test_direct_launch_signatures_split_arguments_exactly_where_triton_compiles_variants():
    """Two calls share a direct launch when their arguments' _specialisation keys are equal; that must mean
    Triton's own specialisation is equal too (else a launch would run a variant compiled for other
    arguments), and the other way round (else each call would go back through Triton's launch path)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    buffer = torch.empty(64, dtype=torch.bfloat16)
    samples = [0, 1, 2, 15, 16, 17, 48, -16, -17, 2**31 - 16, 2**31, 2**31 + 3, 2**63, 2**63 + 16, 0.5, 1.0, -3.0,
               None, True, False, buffer, buffer[1:], buffer[8:], buffer.view(torch.float16),
               torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.float32)[1:]]
    ours = [launch.specialisation(a) for a in samples]
    assert launch.specialisations(samples) == ours
    triton_variants = [native_specialize_impl(CUDABackend, a, False, True, True) for a in samples]
    for i in range(len(samples)):
        for j in range(len(samples)):
            assert (ours[i] == ours[j]) == (triton_variants[i] == triton_variants[j]), (samples[i], samples[j])


@triton.jit
def _defaulted_constexpr_kernel(X, n, BLOCK: tl.constexpr, SCALE: tl.constexpr = 3):
    pass


def test_direct_launch_passes_left_out_constexprs_at_their_defaults():
    direct = launch.CompiledLaunch(_defaulted_constexpr_kernel)
    assert direct._constexprs(2, {"BLOCK": 64, "num_warps": 4}) == (64, 3)
    assert direct._constexprs(2, {"BLOCK": 64, "SCALE": 5}) == (64, 5)


def test_launcher_takes_the_direct_launch_for_fixed_configs_only(monkeypatch):
    """Outside the interpreter a kernel with fixed meta-parameters launches through one CompiledLaunch per
    kernel; an autotuner keeps Triton's own path (it must time its candidates), as does
    FLASHFORMER_DIRECT_LAUNCH=0."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_DIRECT", {})
    direct = launch.launcher(_defaulted_constexpr_kernel, (4, 1, 1))
    assert isinstance(direct.func, launch.CompiledLaunch) and direct.args == ((4, 1, 1),)
    assert launch.launcher(_defaulted_constexpr_kernel, (8,)).func is direct.func
    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 16})], key=["n"])(_defaulted_constexpr_kernel)
    assert not isinstance(launch.launcher(tuned, (1,)), functools.partial)
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    assert not isinstance(launch.launcher(_defaulted_constexpr_kernel, (1,)), functools.partial)


def test_launch_hooks_count_only_when_something_is_registered():
    chain = triton.knobs.HookChain()
    assert launch._no_hook(None) and launch._no_hook(chain)
    chain.add(print)
    assert not launch._no_hook(chain) and not launch._no_hook(print)


def test_short_untabled_launches_skip_the_autotuner(monkeypatch):
    """A first call at a short shape must not compile every candidate config (seconds per shape)."""
    monkeypatch.delenv("FLASHFORMER_AUTOTUNE", raising=False)
    assert not tuning.autotunes(tuning.AUTOTUNE_MIN_SEQLEN // 2)
    assert tuning.autotunes(tuning.AUTOTUNE_MIN_SEQLEN)
    monkeypatch.setenv("FLASHFORMER_AUTOTUNE", "0")
    assert not tuning.autotunes(16384)


def test_gluon_backward_query_tiles_end_inside_the_row_statistics_padding():
    """The Gluon dK/dV kernel reads a query tile's delta and lse unmasked: every BLOCK_M it launches with
    must divide the rows each head's statistics are padded to."""
    from flashformer.kernels import bwd_stats, flash_bwd_hopper
    block_ms = {m for m, _ in flash_bwd_hopper.CONFIGS.values()} | set(flash_bwd_hopper.SOFTCAP_BLOCK_M.values())
    block_ms.add(flash_bwd_hopper.FUSED_BLOCK_M)
    assert all(bwd_stats.STATS_ROWS.value % block_m == 0 for block_m in block_ms), block_ms
