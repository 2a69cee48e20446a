"""The CPU-checkable parts of the benchmark scripts (their timing needs a GPU)."""

import argparse
import cProfile
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashformer.kernels import flash_attn_varlen_func

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _load_script(name):
    """scripts/ is not a package: load one file as a module without running its main()."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where dataclasses look a script's own classes up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load_script("bench_attention")


@pytest.mark.parametrize("kind", ["uniform", "lognormal"])
@pytest.mark.parametrize("tokens,mean", [(16384, 1024), (1000, 64), (1, 8), (50, 4096)])
def test_document_lengths_sum_exactly_and_are_seeded(bench, kind, tokens, mean):
    lengths = bench.document_lengths(tokens, kind, seed=0, mean=mean)
    assert sum(lengths) == tokens and min(lengths) >= 1
    assert all(isinstance(n, int) for n in lengths)
    assert bench.document_lengths(tokens, kind, seed=0, mean=mean) == lengths
    if tokens >= 1000:
        assert bench.document_lengths(tokens, kind, seed=1, mean=mean) != lengths
        assert len(lengths) > 1


def test_lognormal_lengths_mix_short_and_long_documents(bench):
    for seed in range(5):
        lengths = bench.document_lengths(16384, "lognormal", seed=seed, mean=1024)
        assert min(lengths) < 256 and max(lengths) > 2048, lengths
        assert any(n % 64 for n in lengths)  # not aligned to any kernel block size


def test_cudnn_deterministic_flag_holds_for_the_block_and_is_restored(bench):
    import torch
    before = torch.backends.cudnn.deterministic
    with bench.cudnn_deterministic(not before):
        assert torch.backends.cudnn.deterministic is (not before)
    assert torch.backends.cudnn.deterministic is before
    with pytest.raises(RuntimeError), bench.cudnn_deterministic(True):
        raise RuntimeError("a refused shape")
    assert torch.backends.cudnn.deterministic is before
    assert bench.CUDNN_DETERMINISTIC not in bench.SDPA_BACKENDS  # "best SDPA" stays the default flags' cuDNN


def test_bad_arguments_raise(bench):
    with pytest.raises(ValueError):
        bench.document_lengths(0)
    with pytest.raises(ValueError):
        bench.document_lengths(100, "zipf")


def test_cu_seqlens_and_dense_shapes(bench):
    lengths = bench.document_lengths(16384, "lognormal", seed=0)
    cu = bench.cu_seqlens_from_lengths(lengths)
    assert cu.dtype == torch.int32 and cu[0] == 0 and int(cu[-1]) == 16384
    assert cu.diff().tolist() == lengths
    shapes = bench.dense_shapes(lengths)
    batch, seqlen = shapes["mean"]
    assert seqlen % 64 == 0 and abs(seqlen - 16384 / len(lengths)) <= 32 and batch == 16384 // seqlen
    assert shapes["max"] == (max(1, 16384 // max(lengths)), max(lengths))
    assert bench.dense_shapes([10, 20]) == {"mean": (1, 64), "max": (1, 20)}


def test_per_document_reference_matches_varlen(bench):
    lengths = [37, 1, 82]  # few documents: each is a call into the (slow on CPU) dense path
    q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
    cu = bench.cu_seqlens_from_lengths(lengths)
    for causal in (False, True):
        ref = bench.per_document_reference(q, k, v, lengths, causal)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)
        # the script's own metric; torch.testing.assert_close's first call imports DTensor (~1 s)
        assert (out - ref).abs().max().item() < 1e-5


def test_varlen_table(bench):
    cell = {"fwd_tflops": 500.0, "bwd_tflops": 400.0, "fwd_ms": 1.0, "bwd_ms": 2.0}
    section = {"distribution": "lognormal", "seed": 0, "lengths": [100, 924],
               "dense_shapes": bench.dense_shapes([100, 924]),
               "results": [{"head_dim": 128, "causal": True, "docs": 2, "tokens": 1024, "ours-varlen": cell,
                            "ours-tl-varlen": {**cell, "fwd_tflops": 450.0},
                            "ours-dense@mean": {**cell, "fwd_tflops": 550.0}, "ours-dense@max": None,
                            "varlen_over_dense_mean": [500 / 550, 1.0], "max_abs_diff_vs_per_doc": 0.0}]}
    table = bench.varlen_table(section)
    assert "dense@mean = 2 x 512" in table
    assert table.splitlines()[-1] == "| 128 | yes | 2 | 1024 | 500 / 400 | 450 / 400 | 550 / 400 | – | 0.91, 1.00 | – | 0.0e+00 |"


def test_descriptor_benchmark_variants_agree(monkeypatch):
    """bench_descriptors' three kernels (device / host TMA descriptor, pointers) sum the same tiles:
    compiled on a GPU, as the script runs them there, else in Triton's interpreter, as it does without
    one. Not the interpreter on a GPU machine: there triton was imported compiled, other tests have
    launched compiled kernels, and switching TRITON_INTERPRET on mid-session is a mix the script never
    runs in."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench = _load_script("bench_descriptors")
    failed = {name: run for name, run in bench.checked_launchers(3, 2, device).items() if isinstance(run, str)}
    assert not failed, failed


def test_gluon_forward_bench_runs_every_candidate_in_each_variant(capsys):
    """bench_gluon_forward --variants default persistent checks and times each tile shape twice, the
    persistent kernel under names of its own (the JSON and table key on them)."""
    gluon = _load_script("bench_gluon_forward")
    for head_dim, configs in gluon.CANDIDATES.items():
        pairs = gluon.candidates(head_dim, ["default", "persistent"])
        names = [gluon.candidate_name(config, variant) for config, variant in pairs]
        assert sorted(pairs) == sorted((config, variant) for config in configs for variant in ("default", "persistent"))
        assert len(set(names)) == len(names)
        assert [name.endswith("-persistent") for name in names] == [v == "persistent" for _, v in pairs]
    assert gluon.candidates(64, ["persistent"], ["n128-s2-c3"]) == [((128, 2, 3), "persistent")]
    with pytest.raises(SystemExit):
        gluon.main(["--configs", "n96-s2-c3"])
    assert "--configs: unknown ['n96-s2-c3']" in capsys.readouterr().err


def test_plots_draw_the_measured_cells(bench, tmp_path):
    """bench_attention's and bench_decode's --plot write a PNG from their JSON records (a missing
    implementation or a skipped cell left out)."""
    pytest.importorskip("matplotlib")
    cell = {"fwd_tflops": 300.0, "bwd_tflops": 200.0, "fwd_ms": 1.0, "bwd_ms": 2.0}
    results = [{"head_dim": d, "causal": c, "seqlen": s, "batch": 16384 // s, "ours": cell,
                **({"sdpa-flash": cell} if s > 512 else {})}
               for d in (64, 128) for c in (False, True) for s in (512, 1024, 2048)]
    assert bench.plot_grid(results, ["ours", "sdpa-flash"], tmp_path / "grid.png")
    decode = _load_script("bench_decode")
    rates = {name: 1.0 for name in decode.METHODS}
    cells = [{"batch": b, "cache_len": n, "tb_per_s": {**rates, "SDPA flash": None}} for b in (1, 8) for n in (4096, 16384)]
    cells.append({"batch": 64, "cache_len": 131072, "skipped": "skipped (69 GB)"})
    assert decode.plot_cells(cells, tmp_path / "decode.png")
    assert (tmp_path / "grid.png").stat().st_size > 10_000 and (tmp_path / "decode.png").stat().st_size > 10_000


def test_decode_table_shows_both_host_times():
    decode = _load_script("bench_decode")
    rates = {name: 2.0 for name in decode.METHODS}
    cell = {"batch": 1, "cache_len": 16384, "num_splits": 32, "tb_per_s": rates, "ours_host_us": 125.4,
            "cudnn_host_us": 58.2, "max_abs_diff_vs_sdpa_flash": {"ours": 2e-4, "ours paged": 2e-4, "ours graph": 2e-4}}
    header, _, row = decode.markdown([cell, {**cell, "cudnn_host_us": None}]).splitlines()[:3]
    columns = [c.strip() for c in header.strip("|").split("|")]
    values = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
    assert values["ours host µs"] == "125" and values["cuDNN host µs"] == "58"
    assert values["graph: ours / cuDNN"] == "1.00" and values["eager: API, tensor lengths / cuDNN"] == "1.00"
    assert decode.markdown([{**cell, "cudnn_host_us": None}]).splitlines()[2].count("–") == 1


def test_decode_split_sweep_table_lists_each_measured_cell():
    decode = _load_script("bench_decode")
    rates = {name: 3.0 for name in decode.METHODS}
    cell = {"batch": 1, "cache_len": 65536, "num_splits": 50, "tb_per_s": rates,
            "split_sweep_tb_per_s": {"33": 3.1, "64": None}}
    lines = decode.split_sweep_table([cell, {"batch": 64, "cache_len": 131072, "skipped": "skipped"}], [33, 64])
    assert lines.splitlines()[0] == "| batch | cache length | automatic splits | at automatic | 33 splits | 64 splits |"
    assert lines.splitlines()[2:] == ["| 1 | 65536 | 50 | 3.00 | 3.10 | – |"]


def test_decode_launch_configs_parse_and_take_effect_until_the_block_ends():
    decode_bench = _load_script("bench_decode")
    from flashformer.kernels import decode

    assert decode_bench.parse_launch_config("128x8x2") == (128, 8, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="'64x4'"):
        decode_bench.parse_launch_config("64x4")
    chosen = decode._launch_config(torch.device("cpu"), 128, 0)
    with decode_bench.launch_config((16, 2, 1)):
        assert decode._launch_config(torch.device("cpu"), 128, 0) == (16, 2, 1)
    assert decode._launch_config(torch.device("cpu"), 128, 0) == chosen
    cell = {"batch": 8, "cache_len": 16384, "tb_per_s": {"SDPA cuDNN graph": 3.9, "ours graph": 3.8},
            "launch_config_tb_per_s": {"64x4x3": 3.8, "128x8x2": None}}
    lines = decode_bench.launch_config_table([cell], [(64, 4, 3), (128, 8, 2)]).splitlines()
    assert lines[0] == "| batch | cache length | cuDNN | ours as chosen | 64x4x3 | 128x8x2 |"
    assert lines[2] == "| 8 | 16384 | 3.90 | 3.80 | 3.80 | – |"


def test_kernel_times_attribute_time_to_the_ops_that_ran():
    """flashformer.profiling on CPU ops (the GPU path reads the same profiler's device events)."""
    from flashformer.profiling import kernel_times

    a = torch.randn(256, 256)
    times, wall_ms = kernel_times(lambda: (a @ a).relu_(), iters=5, device="cpu")
    assert times["aten::mm"] > 0 and times["aten::relu_"] >= 0
    assert "aten::conv2d" not in times
    assert wall_ms >= times["aten::mm"]


def test_kernel_times_table_lists_each_cell_and_implementation(bench):
    rows = [{"head_dim": 128, "causal": True, "seqlen": 1024,
             "ours": {"kernels": [("_bwd_dkdv_kernel", 0.41), ("_bwd_dq_kernel", 0.38)]},
             "sdpa-flash": {"kernels": [("flash_bwd_kernel", 0.7)]}}]
    table = bench.kernel_times_table(rows, ["ours", "sdpa-flash"]).splitlines()
    assert table[2:] == ["| 128 | yes | 1024 | ours | _bwd_dkdv_kernel | 0.410 |",
                         "| 128 | yes | 1024 | ours | _bwd_dq_kernel | 0.380 |",
                         "| 128 | yes | 1024 | sdpa-flash | flash_bwd_kernel | 0.700 |"]


def test_graph_rows_take_the_graph_cells_and_drop_failed_captures(bench):
    eager = {"fwd_tflops": 100.0, "bwd_tflops": 50.0}
    rows = [{"head_dim": 64, "causal": True, "seqlen": 1024, "batch": 16, "max_abs_diff_vs_sdpa": 0.01,
             "ours": {**eager, "graph": {"fwd_tflops": 120.0, "bwd_tflops": 60.0}},
             "sdpa-flash": {**eager, "graph": None}}]
    (row,) = bench.graph_rows(rows, ["ours", "sdpa-flash"])
    assert row["ours"] == {"fwd_tflops": 120.0, "bwd_tflops": 60.0}
    assert "sdpa-flash" not in row and row["seqlen"] == 1024
    assert "| 120 / 60 | – |" in bench.markdown_table([row], ["ours", "sdpa-flash"])


def test_rounds_merge_into_medians_and_the_table_shows_their_largest_spread(bench):
    rounds = [{"fwd_tflops": 500.0, "bwd_tflops": 300.0, "fwd_ms": 1.0, "bwd_ms": 4.0},
              {"fwd_tflops": 550.0, "bwd_tflops": 303.0, "fwd_ms": 0.9, "bwd_ms": 3.96},
              {"fwd_tflops": 520.0, "bwd_tflops": 297.0, "fwd_ms": 0.95, "bwd_ms": 4.04}]
    cell = bench.merge_rounds(rounds)
    assert (cell["fwd_tflops"], cell["bwd_tflops"], cell["fwd_ms"]) == (520.0, 300.0, 0.95)
    assert cell["spread"]["fwd_tflops"] == pytest.approx(0.1) and len(cell["rounds"]) == 3
    assert bench.merge_rounds(rounds[:1]) is rounds[0]  # one round: the cell as timed
    other = bench.merge_rounds([{"fwd_tflops": 600.0, "bwd_tflops": 400.0}, {"fwd_tflops": 606.0, "bwd_tflops": 480.0}])
    row = {"head_dim": 128, "causal": False, "seqlen": 4096, "batch": 4, "ours": cell, "sdpa-cudnn": other}
    assert bench.markdown_table([row], ["ours", "sdpa-cudnn"]).splitlines()[-1].endswith(" 10.0%, 20.0% |")
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_longctx_bench_runs_a_tiny_lora_step_and_reports_its_plan(tmp_path):
    """bench_longctx_8b on CPU with a 2-layer model: the same build, LoRA, offload and chunked-loss path
    the GPU run takes at 8B, minus the allocator statistics."""
    import json
    import subprocess
    import sys

    command = [sys.executable, os.path.join(SCRIPTS, "bench_longctx_8b.py"), "--device", "cpu", "--layers", "2",
               "--d-model", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--d-ff", "512",
               "--vocab", "1024", "--tokens", "256", "--steps", "1"]
    process = subprocess.run(command, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-3000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("BENCH_LONGCTX_RESULT "))
    record = json.loads(line.split(" ", 1)[1])
    assert (record["status"], record["phase"], record["tokens"], record["offload"]) == ("ok", "done", 256, True)
    assert record["tokens_per_s"] > 0 and record["loss"] > 0 and record["peak_gb"] is None
    assert "estimated device peak" in process.stdout


def test_longctx_bench_full_fine_tunes_a_chosen_config_without_warm_up(capsys):
    """--full --config --set: the model's YAML with overrides, trained fully; --warmup-steps 0 times the first
    step. --set without --full is an error naming the flags."""
    import json

    bench = _load_script("bench_longctx_8b")
    config = os.path.join(os.path.dirname(SCRIPTS), "configs", "models", "tiny-llama.yaml")
    assert bench.main(["--device", "cpu", "--full", "--config", config, "--set", "n_layer=1", "--tokens", "64",
                       "--warmup-steps", "0", "--steps", "1", "--no-offload"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(bench.RESULT_PREFIX))
    record = json.loads(line[len(bench.RESULT_PREFIX):])
    assert record["model"] == "tiny-llama full fine-tune, n_layer=1" and record["status"] == "ok"
    assert "warmup_loss" not in record and record["loss"] > 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--set", "n_layer=1"])
    assert "--config and --set choose the --full model" in capsys.readouterr().err


def test_memory_plan_counts_parameters_exactly_and_offload_moves_block_inputs_to_the_host():
    from flashformer.config import load_config
    from flashformer.lora import LoRAConfig, apply_lora
    from flashformer.memory import adapter_count, memory_plan, parameter_count
    from flashformer.model import ModelConfig, Transformer

    configs = [load_config(ModelConfig, os.path.join(os.path.dirname(SCRIPTS), "configs", "models", name))
               for name in ("llama-1b.yaml", "gemma2-2b.yaml", "tiny-gpt2.yaml")]
    for config in configs:
        with torch.device("meta"):
            model = Transformer(config)
        assert parameter_count(config) == model.num_params(), config.family
    llama, lora = configs[0], LoRAConfig(rank=16)
    with torch.device("meta"):
        adapted = apply_lora(Transformer(llama), lora)
    assert adapter_count(llama, lora) == sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    plain, offloaded = (memory_plan(llama, 65536, lora, mode) for mode in (True, "offload"))
    moved = llama.n_layer * llama.d_model * 2 * 65536  # bf16 block inputs
    assert plain["estimated_peak"] - offloaded["estimated_peak"] == moved == offloaded["host_activations"]
    assert plain["weights"] == parameter_count(llama) * 2 + adapter_count(llama, lora) * 4
    assert memory_plan(llama, 65536, None, False)["estimated_peak"] > plain["estimated_peak"]


@pytest.mark.parametrize("lora_rank", [0, 16])
def test_memory_plan_block_estimate_is_what_autograd_saves(lora_rank):
    """One Llama block under bf16 autocast on CPU: the bytes of every distinct storage autograd saves
    that holds a token dimension (weights and their bf16 casts left out), per token."""
    from flashformer.lora import LoRAConfig, apply_lora
    from flashformer.memory import block_activation_bytes_per_token
    from flashformer.model import ModelConfig, Transformer

    tokens = 512  # no other dimension of the model has this size
    config = ModelConfig(family="llama", vocab_size=128, d_model=256, n_layer=1, n_head=4, n_kv_head=2, head_dim=64,
                         d_ff=896, max_seq_len=tokens, tie_embeddings=False)
    lora = LoRAConfig(rank=lora_rank)
    model = Transformer(config)
    if lora.enabled:
        apply_lora(model.to(torch.bfloat16), lora)
    saved = {}

    def pack(tensor):
        if tokens in tensor.shape:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    x = model.embed(torch.randint(0, 128, (1, tokens))).detach().requires_grad_(True)
    rope = model.rope(torch.arange(tokens)[None])
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.blocks[0](x, rope, model.attn_backend, model.deterministic)
    for shared in (x, *rope):  # the block's input and the rotary tables belong to the model, not the block
        saved.pop(shared.untyped_storage().data_ptr(), None)
    residual_bytes = x.element_size()
    assert sum(saved.values()) / tokens == block_activation_bytes_per_token(config, residual_bytes, 2, lora)


# What `ncu --csv --print-units base --metrics dram__bytes_read.sum,dram__bytes_write.sum` prints for a
# profiled backward of three kernels, with the program's own output interleaved; units and thousands
# separators vary as ncu prints them without --print-units base.
NCU_CSV = """\
==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "_attn_bwd_preprocess" - 0: 0%....50%....100% - 1 pass
==PROF== Profiling "_attn_bwd_dkdv" - 1: 0%....50%....100% - 1 pass
warm-up done
==PROF== Profiling "_attn_bwd_dq" - 2: 0%....50%....100% - 1 pass
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","_attn_bwd_preprocess","1","7","(128, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","33,554,432"
"0","4242","python3.12","127.0.0.1","_attn_bwd_preprocess","1","7","(128, 1, 1)","(32, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","262.14"
"1","4242","python3.12","127.0.0.1","_attn_bwd_dkdv","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","92.5"
"1","4242","python3.12","127.0.0.1","_attn_bwd_dkdv","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","33554432"
"2","4242","python3.12","127.0.0.1","_attn_bwd_dq","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Gbyte","0.1"
"2","4242","python3.12","127.0.0.1","_attn_bwd_dq","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","16,777,216"
"2","4242","python3.12","127.0.0.1","_attn_bwd_dq","1","7","(256, 1, 1)","(8, 64, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,024"
"""


@pytest.fixture(scope="module")
def hbm():
    return _load_script("hbm_traffic")


@pytest.mark.parametrize("batch,heads,seqlen,head_dim", [(4, 16, 1024, 128), (1, 3, 77, 64)])
def test_hbm_floor_is_the_bytes_of_the_tensors_an_exact_attention_must_move(hbm, batch, heads, seqlen, head_dim):
    def nbytes(*tensors):
        return sum(t.nbytes for t in tensors)

    q, k, v, o, grad_out, dq, dk, dv = (torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16,
                                                    device="meta") for _ in range(8))
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device="meta")
    assert hbm.floor_bytes(batch, heads, seqlen, head_dim, "fwd") == (nbytes(q, k, v), nbytes(o, lse))
    assert hbm.floor_bytes(batch, heads, seqlen, head_dim, "bwd") == (nbytes(q, k, v, o, grad_out, lse),
                                                                      nbytes(dq, dk, dv))
    with pytest.raises(ValueError, match="pass_"):
        hbm.floor_bytes(batch, heads, seqlen, head_dim, "both")


def test_hbm_ncu_csv_is_summed_over_kernels_in_bytes(hbm):
    rows = hbm.parse_ncu_csv(NCU_CSV)
    assert len(rows) == 7 and rows[0]["Kernel Name"] == "_attn_bwd_preprocess"
    read, written, kernels = hbm.dram_bytes(rows)
    assert kernels == 3
    assert read == pytest.approx(33_554_432 + 92.5e6 + 0.1e9, rel=1e-12)
    assert written == pytest.approx(262.14e3 + 33_554_432 + 16_777_216, rel=1e-12)


def test_hbm_ncu_csv_errors_name_what_is_wrong(hbm):
    assert hbm.parse_ncu_csv("==PROF== Disconnected from process 4242\n") == []
    with pytest.raises(ValueError, match="no kernel was profiled"):
        hbm.dram_bytes([])
    with pytest.raises(ValueError, match="'byte/second'"):
        hbm.dram_bytes(hbm.parse_ncu_csv(NCU_CSV.replace('"Kbyte"', '"byte/second"')))
    with pytest.raises(ValueError, match="'n/a' for kernel '_attn_bwd_dq'"):
        hbm.dram_bytes(hbm.parse_ncu_csv(NCU_CSV.replace('"16,777,216"', '"n/a"')))


def test_hbm_child_command_profiles_one_range_of_this_script(hbm):
    command = hbm.ncu_command("/opt/ncu", "sdpa-cudnn", "bwd", 4096, 128, 4, 16)
    assert command[0] == "/opt/ncu"
    flags = " ".join(command[1:command.index(sys.executable)])
    assert flags == ("--metrics dram__bytes_read.sum,dram__bytes_write.sum --csv --print-units base "
                     "--target-processes all --profile-from-start off")
    child = command[command.index(sys.executable) + 1:]
    assert child[0] == os.path.join(SCRIPTS, "hbm_traffic.py")
    assert child[1:] == ["--child", "sdpa-cudnn", "bwd", "--seqlens", "4096", "--head-dims", "128",
                         "--batch", "4", "--heads", "16"]


# What `ncu --page raw --csv --print-units base` prints for a profiled backward of two kernels (one counter
# per column, the units on the line after the header), with the program's own output before it; each of
# ncu's lines is one line here (a backslash at a line's end continues it).
NCU_RAW_CSV = """\
==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "attn_bwd_dkdv" - 0: 0%....50%....100% - 38 passes
==PROF== Profiling "attn_bwd_dq" - 1: 0%....50%....100% - 38 passes
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",\
"gpu__time_duration.sum","launch__registers_per_thread","sm__issue_active.avg.pct_of_peak_sustained_elapsed",\
"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",\
"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","sm__warps_active.avg.pct_of_peak_sustained_active",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio"
"","","","","","","","","","","","nsecond","register/thread","%","%","%","%","inst","inst","inst","inst","inst"
"0","4242","python3.12","127.0.0.1","attn_bwd_dkdv","1","7","(384, 1, 1)","(128, 16, 1)","0","9.0",\
"2,081,184","240","31.5","71.25","0","18.7","0.9","3.25","1.5","0.4","2.1"
"1","4242","python3.12","127.0.0.1","attn_bwd_dq","1","7","(384, 1, 1)","(128, 16, 1)","0","9.0",\
"1,193,000","n/a","28","64.5","0","18.7","0.2","1.1","2.5","0.3","0"
"""


@pytest.fixture(scope="module")
def counters(hbm):  # kernel_counters imports hbm_traffic, loaded by the hbm fixture
    return _load_script("kernel_counters")


def test_kernel_counters_read_every_kernel_and_pick_what_the_table_shows(counters):
    kernels = counters.parse_raw_csv(NCU_RAW_CSV)
    assert [kernel["Kernel Name"] for kernel in kernels] == ["attn_bwd_dkdv", "attn_bwd_dq"]
    assert kernels[0]["gpu__time_duration.sum"] == 2_081_184.0 and kernels[1]["launch__registers_per_thread"] == "n/a"
    dkdv, dq = map(counters.summary, kernels)
    assert dkdv == {"kernel": "attn_bwd_dkdv", "us": pytest.approx(2081.184), "registers": 240.0,
                    "tensor_pipe_pct": 71.25, "issue_busy_pct": 31.5, "warps_active_pct": 18.7,
                    "top_stalls": [("long_scoreboard", 3.25), ("sleeping", 2.1), ("math_pipe_throttle", 1.5),
                                   ("barrier", 0.9)]}
    assert dq["registers"] is None and dq["top_stalls"][0] == ("math_pipe_throttle", 2.5)
    assert counters.summary({"Kernel Name": "k"})["tensor_pipe_pct"] is None
    assert counters.parse_raw_csv("==PROF== Disconnected from process 4242\n") == []
    lines = counters.table([{"impl": "ours", "pass": "bwd", "seqlen": 4096, "head_dim": 128, "kernels": kernels},
                            {"impl": "sdpa-cudnn", "pass": "bwd", "seqlen": 4096, "head_dim": 128,
                             "error": "ncu child ran past --timeout 240 s"}]).splitlines()
    assert len(lines) == 5
    assert lines[2] == ("| ours | bwd | 128 | 4096 | attn_bwd_dkdv | 2081.2 | 240 | 71.2 | 31.5 | 18.7 | "
                        "long_scoreboard 3.2, sleeping 2.1, math_pipe_throttle 1.5, barrier 0.9 |")
    assert lines[4].startswith("| sdpa-cudnn | bwd | 128 | 4096 | error: ncu child ran past --timeout 240 s |")


def test_kernel_counters_profile_hbm_traffic_child_with_the_clocks_left_alone(counters):
    command = counters.ncu_command("/opt/ncu", "ours-nondet", "bwd", 16384, 128, 1, 16)
    child = command[command.index(sys.executable) + 1:]
    assert child == [os.path.join(SCRIPTS, "hbm_traffic.py"), "--child", "ours-nondet", "bwd", "--seqlens", "16384",
                     "--head-dims", "128", "--batch", "1", "--heads", "16"]
    flags = command[1:command.index(sys.executable)]
    assert flags[flags.index("--clock-control") + 1] == "none" and flags[flags.index("--page") + 1] == "raw"
    assert [flags[i + 1] for i, flag in enumerate(flags) if flag == "--section"] == list(counters.SECTIONS)


def test_hbm_parent_and_child_refuse_what_they_cannot_run(tmp_path):
    script = os.path.join(SCRIPTS, "hbm_traffic.py")
    missing = subprocess.run([sys.executable, script, "--ncu", str(tmp_path / "ncu"), "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Nsight Compute's CLI is not on PATH" in missing.stderr
    assert not (tmp_path / "x.json").exists()
    bad_child = subprocess.run([sys.executable, script, "--child", "flex", "fwd"], capture_output=True, text=True,
                               timeout=120)
    assert bad_child.returncode == 2 and "--child takes one of" in bad_child.stderr


def test_hbm_table_and_plot_show_measured_cells_and_say_why_others_are_missing(hbm, tmp_path):
    rows = []
    for impl in ("ours", "materialized"):
        for pass_ in hbm.PASSES:
            for seqlen in (1024, 4096):
                read, written = hbm.floor_bytes(4, 16, seqlen, 128, pass_)
                row = {"impl": impl, "pass": pass_, "seqlen": seqlen, "head_dim": 128, "floor_read": read,
                       "floor_written": written}
                if impl == "materialized" and seqlen == 4096:
                    row["error"] = "skipped: the score matrices do not fit above 1024"
                else:
                    row.update(read=2 * read, written=written, kernels=3)
                rows.append(row)
    lines = hbm.table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    ours_fwd = next(line for line in lines if line.startswith("| ours | fwd | 128 | 1024 |")).split(" | ")
    read, written = hbm.floor_bytes(4, 16, 1024, 128, "fwd")
    assert float(ours_fwd[-1].rstrip(" |")) == round((2 * read + written) / (read + written), 2)
    assert sum("skipped: the score matrices" in line for line in lines) == 2
    pytest.importorskip("matplotlib")
    assert hbm.plot(rows, tmp_path / "hbm.png")
    assert (tmp_path / "hbm.png").stat().st_size > 0


@pytest.mark.parametrize("seqlen", [1, 7, 64, 129])
@pytest.mark.parametrize("causal, window_left", [(False, -1), (True, -1), (True, 0), (True, 5), (True, 300)])
def test_first_call_counts_the_pairs_each_mask_attends(seqlen, causal, window_left):
    first_call = _load_script("bench_first_call")
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    attended = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if causal:
        attended &= cols <= rows
    if window_left >= 0:
        attended &= cols >= rows - window_left
    assert first_call.attended_pairs(seqlen, causal, window_left) == int(attended.sum())


def test_first_call_table_sets_cudnns_ratio_beside_ours_where_cudnn_ran():
    first_call = _load_script("bench_first_call")
    tuned = [{"shape": "7x1024x96:causal", "tflops": 109.0, "forward_tflops": 294.0, "kernel_tflops": 202.0,
              "cudnn_kernel_tflops": 250.0}]
    row = {"shape": "9x900x96:causal", "first_step_s": 5.7, "tflops": 84.0, "forward_tflops": 247.0,
           "kernel_tflops": 166.0, "cudnn_kernel_tflops": 200.0, "tuned": tuned,
           "nearest_tuned": "7x1024x96:causal", "tuned_shape": "7x1024x96:causal"}
    window = {**row, "shape": "5x2500x128:window256", "tuned": [{**tuned[0], "shape": "7x1024x96:causal"}]}
    del window["cudnn_kernel_tflops"]
    first, second = first_call.markdown_table([row, window]).splitlines()[2:]
    assert first.endswith("| 0.82 | 0.80 |") and second.endswith("| 0.82 | - |")


def test_first_call_shapes_parse_and_bad_ones_name_the_spec():
    first_call = _load_script("bench_first_call")
    assert first_call.parse_shape("23x704x128") == (23, 704, 128, {"causal": True})
    assert first_call.parse_shape("5x2500x128:window256") == (5, 2500, 128, {"causal": True, "window_size": (256, 0)})
    assert first_call.parse_shape("4x3000x64:softcap30") == (4, 3000, 64, {"causal": True, "softcap": 30.0})
    assert first_call.parse_shape("7x1500x64:full") == (7, 1500, 64, {"causal": False})
    for spec in first_call.DEFAULT_SHAPES:
        first_call.parse_shape(spec)
    for bad in ("23x704", "23x704x128:sliding", "0x704x128", "axbxc"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            first_call.parse_shape(bad)
    # The tuned shapes beside one keep its tokens at the powers of two around its length; the last one picks
    # the tiles, the nearest is nearest as a ratio of lengths.
    assert first_call.tuned_neighbours(23, 704) == [(31, 512), (15, 1024)]
    assert first_call.nearest(704, [(31, 512), (15, 1024)]) == (31, 512)
    # and its mask: a window or a softcap is compared with itself at the tuned lengths
    assert [first_call.mask_name(spec) for spec in ("23x704x128", "5x2500x128:window256", "7x1500x64:full")] == \
        ["causal", "window256", "full"]
    assert first_call.tuned_neighbours(3, 3000) == [(4, 2048), (2, 4096)]
    assert first_call.nearest(3000, [(4, 2048), (2, 4096)]) == (2, 4096)
    assert first_call.tuned_neighbours(4, 1024) == [(4, 1024)] and first_call.tuned_neighbours(1, 1) == [(1, 1)]
    assert first_call.tuned_neighbours(1, 12000) == [(1, 8192), (1, 16384)]


def test_first_call_table_shows_the_step_without_compile_ahead_where_it_was_timed():
    first_call = _load_script("bench_first_call")
    row = {"shape": "23x704x128:causal", "first_step_s": 5.04, "tflops": 300.0, "forward_tflops": 320.0,
           "kernel_tflops": 330.0,
           "tuned": [{"shape": "31x512x128:causal", "tflops": 250.0, "forward_tflops": 260.0, "kernel_tflops": 300.0},
                     {"shape": "15x1024x128:causal", "tflops": 400.0, "forward_tflops": 420.0, "kernel_tflops": 410.0}],
           "nearest_tuned": "31x512x128:causal", "tuned_shape": "15x1024x128:causal"}
    table = first_call.markdown_table([{**row, "first_step_without_compile_ahead_s": 10.0}, row])
    assert "| 23x704x128:causal | 5.0 | 10.0 | - | 300 / 320 |" in table
    assert ("| 23x704x128:causal | 5.0 | - | - | 300 / 320 | 31x512x128:causal 250 / 260, 15x1024x128:causal 400 / 420 "
            "| 1.20 | 0.75 | 1.10 |") in table


def test_host_bench_shapes_parse_and_its_table_shows_host_over_device():
    host = _load_script("bench_host")
    assert host.parse_shape("15x1024x16x128") == (15, 1024, 16, 128, True)
    assert host.parse_shape("2x64x4x32:full") == (2, 64, 4, 32, False)
    for bad in ("15x1024x16", "1x2x3x4:sliding", "0x1x1x1"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            host.parse_shape(bad)
    timing = {"host_ms": 0.5, "device_ms": 0.25}
    row = {"shape": "15x1024x16x128", "mode": "direct", **{call: timing for call in (
        "ours forward", "ours forward + backward", "cuDNN forward", "cuDNN forward + backward")}}
    table = host.markdown([row, {"shape": "1x1x1x16", "mode": "direct", "error": "boom"}]).splitlines()
    assert table[2] == "| 15x1024x16x128 | direct | ours forward | 0.500 | 0.250 | 2.00 |"
    assert table[-1].startswith("| 1x1x1x16 | direct | error: boom |")


def test_host_profile_names_the_functions_of_most_own_time_per_call():
    from flashformer.profiling import top_functions

    def busy(n):
        return sum(i * i for i in range(n))

    def call():
        busy(20000)
        len("x")

    profiler = cProfile.Profile()
    for _ in range(4):
        profiler.runcall(call)
    rows = top_functions(profiler, 4, 3)
    assert len(rows) == 3 and all(own <= cumulative for _, _, own, cumulative in rows)
    names = [name for name, *_ in rows]
    assert any("(busy)" in name or "(<genexpr>)" in name for name in names), names
    busy_row = next(row for row in rows if "(busy)" in row[0] or "(<genexpr>)" in row[0])
    assert busy_row[1] >= 1  # calls per profiled call


@pytest.fixture(scope="module")
def determinism(bench):  # check_determinism imports bench_attention, loaded by the bench fixture
    return _load_script("check_determinism")


class _NoisyGradient(torch.autograd.Function):
    """The identity, whose backward adds fresh noise to the gradient: a nondeterministic backward in one input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad + 1e-9 * torch.randn_like(grad)


def _exact_attention(q, k, v, causal):
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_determinism_check_counts_only_the_runs_that_differ(determinism):
    """Exact attention on CPU repeats bit for bit; with noise added to dk's gradient every run differs there only."""
    q, k, v, grad_out = (torch.randn(2, 33, 2, 16, dtype=torch.float64) for _ in range(4))
    assert determinism.repeatability(_exact_attention, q, k, v, True, grad_out, runs=3) == ([0, 0, 0], [0.0] * 3)
    noisy_dk = lambda q, k, v, causal: _exact_attention(q, _NoisyGradient.apply(k), v, causal)  # noqa: E731
    differing, largest = determinism.repeatability(noisy_dk, q, k, v, True, grad_out, runs=3)
    assert differing == [0, 3, 0] and 0.0 < largest[1] < 1e-7


def test_determinism_check_rejects_bad_arguments(determinism, capsys):
    for argv, name in ((["--shape", "4x4096x16"], "--shape"), (["--runs", "0"], "--runs")):
        with pytest.raises(SystemExit):
            determinism.main(argv)
        assert name in capsys.readouterr().err


def test_with_tree_runs_a_script_against_another_commits_package(tmp_path):
    """An exported commit's kernels are the ones a script run through `with_tree.py run` imports: at the commit
    before the dK/dV kernel took its row statistics by TMA, flash_bwd_hopper still has the helper that loaded them."""
    repo = os.path.dirname(SCRIPTS)
    if subprocess.run(["git", "-C", repo, "cat-file", "-e", "0c1b98a"], capture_output=True).returncode:
        pytest.skip("needs the repository's git history")
    tree = tmp_path / "tree"
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "with_tree.py"), "export", "0c1b98a", str(tree)],
                   cwd=repo, check=True)
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nfrom flashformer.kernels import flash_bwd_hopper\n"
                     "print(flash_bwd_hopper.__file__, hasattr(flash_bwd_hopper, '_row_stats'), sys.argv[1:])\n")
    ran = subprocess.run([sys.executable, os.path.join(SCRIPTS, "with_tree.py"), "run", str(tree), str(probe), "--x",
                          "1"], capture_output=True, text=True, check=True)
    path, had_helper, args = ran.stdout.split(" ", 2)
    assert path.startswith(str(tree)) and had_helper == "True" and args.strip() == "['--x', '1']"
    from flashformer.kernels import flash_bwd_hopper
    assert not hasattr(flash_bwd_hopper, "_row_stats")  # this tree's kernels, for contrast
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, os.path.join(SCRIPTS, "with_tree.py"), "export", "0c1b98a", str(tree)],
                       cwd=repo, check=True, capture_output=True)


def test_provenance_names_the_checkout_flashformer_runs_from_whatever_the_working_directory(tmp_path):
    """A benchmark run from outside the repository still records the commit of the code it ran."""
    repo = os.path.dirname(SCRIPTS)
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    code = "from flashformer.profiling import benchmark_provenance; print(benchmark_provenance()['commit'])"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    commit = done.stdout.strip().splitlines()[-1]
    assert commit.split("+")[0] == head.stdout.strip(), commit


def test_tune_attention_records_the_capability_and_times_the_fallback_tables_pick(tmp_path):
    tune = _load_script("tune_attention")
    path = tmp_path / "tuned.json"
    h200 = {"capability": "9.0", "fwd": {"d64-full": {"4096": [128, 64, 8, 2]}}}
    path.write_text(json.dumps({"NVIDIA H200": h200}))
    best, other = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, tune.tuning.config_from_shape(
        [128, 64, 8, 2])
    picks = {kind: (best, 1.0, 1.5, 1.25 if kind == "fwd" else float("nan")) for kind in tune.KINDS}
    row = {"head_dim": 64, "seqlen": 4096, "heads": 32, "causal": False, "picks": picks}
    tune.write_table(str(path), "NVIDIA H100 80GB HBM3", "9.0", [row])
    tables = tune.read_tables(str(path))
    assert tables["NVIDIA H200"] == h200  # another GPU's entries kept
    assert tables["NVIDIA H100 80GB HBM3"]["capability"] == "9.0"
    assert tables["NVIDIA H100 80GB HBM3"]["fwd"]["d64-full"]["4096"] == [64, 64, 4, 3]
    assert tune.tuning.config_in_table(h200, "fwd", 64, False, 4096) == other
    header, rule, line = tune.markdown_table([row], "NVIDIA H200").splitlines()
    assert header.count("NVIDIA H200's pick") == 4 and rule.count("---") == 3 + 12
    assert "| 64x64 w4 s3 | 1.50 | 0.80 | 64x64 w4 s3 | 1.50 | - |" in line  # 1.0 ms against the fallback's 1.25
    header, rule, line = tune.markdown_table([row]).splitlines()  # no table to fall back to: no such column
    assert "'s pick" not in header and rule.count("---") == 3 + 8 and line.endswith("| 64x64 w4 s3 | 1.50 |")


def test_prefill_counts_the_pairs_a_bottom_right_mask_keeps():
    prefill = _load_script("bench_prefill")
    for cached, new in ((0, 7), (5, 3), (16, 16), (9, 1)):
        kept = torch.ones(new, cached + new).tril(diagonal=cached).sum().item()  # query i sees keys <= cached + i
        assert prefill.causal_pairs(cached, new) == kept
    assert prefill.parse_cell("8x32:8x128x4096x256") == (8, 32, 8, 128, 4096, 256)
    with pytest.raises(argparse.ArgumentTypeError, match="BxHQ:HKVxDxCACHEDxNEW"):
        prefill.parse_cell("8x32x128x0x256")


def test_prefill_pages_hold_the_cache_in_the_block_tables_order():
    prefill = _load_script("bench_prefill")
    k_cache, v_cache = torch.randn(3, 37, 2, 8), torch.randn(3, 37, 2, 8)
    k_pool, v_pool, block_table = prefill.paged_copy(k_cache, v_cache, 16)
    assert k_pool.shape == (9, 16, 2, 8) and block_table.shape == (3, 3) and block_table.dtype == torch.int32
    assert sorted(block_table.flatten().tolist()) == list(range(9))
    for pool, cache in ((k_pool, k_cache), (v_pool, v_cache)):
        assert torch.equal(pool[block_table.long()].flatten(1, 2)[:, :37], cache)


def test_prefill_tables_have_a_column_per_call():
    prefill = _load_script("bench_prefill")
    cell = {"batch": 2, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "cached": 0, "new": 512,
            "ms": {m: 0.25 for m in prefill.METHODS}, "tflops": {m: 100.0 for m in prefill.METHODS},
            "host_ms": {m: 0.04 for m in prefill.METHODS[:6]}}
    cell["tflops"]["SDPA flash"] = None  # a backend that refused the shape
    header, rule, line = prefill.markdown([cell]).splitlines()
    assert header.count("|") == rule.count("|") == line.count("|")
    assert line.startswith("| 2 | 32:8 | 128 | 0 | 512 | 100 |") and "| - |" in line
    header, rule, line = prefill.host_markdown([cell]).splitlines()
    assert header.count("|") == rule.count("|") == line.count("|") == 5 + 6 + 1
    assert line.endswith("| 40 / 250 | 40 / 250 |")
    cell["kernel_ms"] = {"ours API, tensor lengths": [("_attn_fwd_kernel", 0.2125), ("rows_kernel", 0.0041)]}
    header, rule, *lines = prefill.kernel_markdown([cell]).splitlines()
    assert header.count("|") == rule.count("|") == 9 and all(line.count("|") == 9 for line in lines)
    assert lines == ["| 2 | 32:8 | 128 | 0 | 512 | ours API, tensor lengths | _attn_fwd_kernel | 212.5 |",
                     "| 2 | 32:8 | 128 | 0 | 512 | ours API, tensor lengths | rows_kernel | 4.1 |"]
