"""Our kernels compile for the H200 (sm_90) without a GPU, and use Hopper's wgmma and TMA.

CI has no GPU; the interpreter runs the kernels' logic but not Triton's compiler. This compiles
each kernel family (dense / varlen, masks, GQA, head_dims 64-256, decode) down to a cubin with the
ptxas that Triton ships, in child processes without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys

import pytest
import triton

from session_cache import built_once
from flashformer.kernels.interface import GLUON_TRITON_VERSIONS

HOPPER_MATRIX_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused", "decode-", "gluon-")
# On another Triton the Gluon kernels never run (the tl kernels take their place), and hopper_compile.py skips them.
needs_gluon_triton = pytest.mark.skipif(not triton.__version__.startswith(GLUON_TRITON_VERSIONS),
                                        reason=f"the Gluon kernels run on Triton {GLUON_TRITON_VERSIONS} only, "
                                               f"not {triton.__version__}")


def compile_report(directory):
    """Run hopper_compile.py over its cases, one child per usable core, each on every n-th case (a compile keeps
    one core busy for seconds: three minutes of one core in all); write their merged report."""
    from hopper_compile import cases_to_compile  # here: it imports Triton's compiler, which CI's Triton may lack

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "hopper_compile.py")
    names = cases_to_compile()
    # At most 8: each child's start-up (torch, triton) costs seconds of its own.
    children = min(len(os.sched_getaffinity(0)), 8, len(names))
    running = [subprocess.Popen([sys.executable, script, *names[i::children]], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(children)]
    report = {}
    for child in running:
        stdout, stderr = child.communicate(timeout=900)
        assert child.returncode == 0, stderr[-3000:]
        report.update(json.loads(stdout.strip().splitlines()[-1]))
    assert sorted(report) == sorted(names)
    (directory / "report.json").write_text(json.dumps(report))


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    """The compile report, built once however xdist hands these tests to its workers (the others wait for it)."""
    return json.loads((built_once(tmp_path_factory, "hopper-compile", compile_report) / "report.json").read_text())


def test_every_kernel_compiles_for_sm90(report):
    failures = {name: case["error"] for name, case in report.items() if "error" in case}
    assert not failures, failures


def test_attention_kernels_use_wgmma_and_tma(report):
    for name, case in report.items():
        if name.startswith(HOPPER_MATRIX_KERNELS):
            assert case["wgmma"] and case["tma"], f"{name}: wgmma={case['wgmma']} tma={case['tma']}"
            assert case["shared_bytes"] <= 227 * 1024, f"{name} needs {case['shared_bytes']} B of shared memory"


def test_head_dim_256_backward_fits_the_registers(report):
    """The default head_dim-256 backward configs (kernels/tuning.py) keep their accumulators in
    registers: a few hundred bytes of spill at most (4 warps spilled 7.8 KB per thread; the 8-warp
    dK/dV kernel spills 464 B with 32-bit base offsets, 520 B with the 64-bit ones)."""
    for name in ("bwd_dkdv-d256", "bwd_dq-d256"):
        assert report[name]["spill_bytes"] <= 640, report[name]


def test_register_capped_candidates_fit_two_programs_per_sm(report):
    """maxnreg 128 at 8 warps (kernels/tuning.py) is there so that two programs share an SM: it must
    not spill, and each program must leave the other half of the shared memory."""
    for name in ("fwd-d128-two-per-sm", "bwd_dq-d128-two-per-sm"):
        case = report[name]
        assert case["registers"] <= 128 and case["spill_bytes"] == 0, (name, case)
        assert case["shared_bytes"] <= 227 * 1024 // 2, (name, case)


def test_dkdv_kernel_keeps_three_programs_per_sm_at_ragged_lengths(report):
    """At head_dim 64 (64 x 64 tiles, 4 warps, 3 stages) the tl dK/dV kernel holds three programs per SM
    (<= 168 registers of 65536 / 384 threads); a length not divisible by 16 must not cost it one. With
    per-row masks on its statistics' loads it took 191 registers, and 1.6x the time of a length 8 tokens
    shorter on the H200 (bwd_stats.py pads the statistics instead)."""
    case = report["bwd_dkdv-d64-causal-ragged"]
    assert case["registers"] <= 168 and case["spill_bytes"] == 0, case


def test_paged_forward_pipelines_its_key_rows(report):
    """The tl forward over a paged cache reads key and value rows with pointer loads (a tile may span pages, so
    no TMA view covers it): launched on aligned tensors they compile to asynchronous copies into shared memory,
    pipelined over the key loop (more than one tile's buffers), and nothing spills. Scalar, unpipelined loads
    (what unaligned strides give) took 255 registers and spilled 928 B."""
    paged, dense = report["fwd-d128-paged-causal-gqa"], report["fwd-d128-causal"]
    assert paged["cp_async"] and paged["global_loads"] <= 8 and paged["spill_bytes"] == 0, paged
    assert paged["shared_bytes"] > 2 * 2 * 64 * 128 * 2, paged  # K and V tiles of 64 x 128 bf16, twice
    assert not dense["cp_async"], dense


def test_nondeterministic_backward_reduces_dq_through_tma(report):
    """deterministic=False (and the fused Gluon backward) add dQ shares with TMA bulk reductions
    (cp.reduce.async.bulk), not element-wise atomics; the deterministic kernels issue none."""
    for name, case in report.items():
        assert case.get("tma_reduce", False) == name.startswith(("bwd_fused", "gluon-bwd_fused")), (name, case)


# The Gluon dK/dV kernel at BLOCK_M = 64 (flash_bwd_hopper.CONFIGS): its four accumulators take 192 of a
# consumer's 240 registers. With the row statistics read from shared memory it spills nothing at head_dim 128 and
# a scalar or two at 80 and with softcap; at 192-256 the 64-bit shared-memory descriptors of the 16 k-steps of S^T
# and dP^T (reloaded once per query tile).
# The fused Gluon backward (dQ formed in the dK/dV kernel) keeps a few more scalars beside its accumulators at
# head_dim 128 (the dQ share's stage and descriptor, the semaphore's rank): stored before the query loop,
# each reloaded once per query tile (six to eight 4-byte reloads per tile; no store in the loop); at head_dim
# 64 with softcap a scalar or two. The ordered forms also carry the previous tile's semaphore across the loop
# (released a tile late): 30-130 B more at head_dim 128.
# At head_dim 64 the dK/dV kernel's BLOCK_M 128 (S^T and dP^T of 64 registers each) leaves six scalars in
# local memory: six 4-byte stores and reloads per query tile in an 840-instruction loop (the SASS),
# included in the H200 timing that made it the default (1.00-1.12x the tl kernels).
# The persistent forward carries its tile loop's state (tile, ring counters, buffer) across the key loop:
# ptxas keeps a value or two of it in local memory at 160-232 registers per consumer. Its tiles overlapped at
# their boundaries (two products and the epilogue live at once) leave more there: reloaded once per tile, and
# once per masked key tile at most (the SASS: no local access in the unmasked key loop).
GLUON_SPILL_BOUND = {"gluon-bwd_dkdv-d80-window": 16, "gluon-bwd_dkdv-d256-causal-gqa": 384,
                     "gluon-bwd_dkdv-d192-window": 512, "gluon-bwd_dkdv-d64-causal-gqa": 128,
                     "gluon-bwd_dkdv-d256-full-softcap": 32,
                     "gluon-fwd-d128-persistent-causal": 384, "gluon-fwd-d128-persistent-full": 256,
                     "gluon-fwd-d64-c3-persistent-full": 704, "gluon-fwd-d128-persistent-causal-in-turn": 64,
                     "gluon-fwd-d64-c3-persistent-full-in-turn": 64, "gluon-fwd-d128-persistent-causal-own-pace": 384,
                     "gluon-bwd_fused-d128-causal-gqa": 576, "gluon-bwd_fused-d128-full": 512,
                     "gluon-bwd_fused_unordered-d128-causal": 512, "gluon-bwd_fused_unordered-d128-full-gqa": 512,
                     "gluon-bwd_fused_unordered-d80-window": 512, "gluon-bwd_fused-d64-window-softcap-gqa": 64}
# Packed sequences (varlen) keep their sequence's offsets and bounds (loaded from cu_seqlens, not formed from the
# program ids) beside the same accumulators: 340 B in the dK/dV kernel at head_dim 128, 584 at 256; the H200 timing
# of bench_attention --varlen --impls ours ours-tl includes them.
GLUON_SPILL_BOUND.update({"gluon-bwd_dkdv-d128-varlen-causal-gqa": 384, "gluon-bwd_dkdv-d256-varlen-full": 640})
# The fused form with dQ's columns split between the consumers (DQ_SPLIT): the same kind of scalars, fewer
# of them beside its 32-register dQ half (124-488 B at head_dim 128, against up to 572 for the shares).
GLUON_SPILL_BOUND.update({"gluon-bwd_fused_split-d128-causal": 512, "gluon-bwd_fused_split-d128-full-gqa": 320,
                          "gluon-bwd_fused_unordered_split-d128-causal-gqa": 384,
                          "gluon-bwd_fused_unordered_split-d128-full": 128,
                          "gluon-bwd_fused_unordered_split-d80-window": 224,
                          "gluon-bwd_fused_split-d64-window-softcap-gqa": 128})


@needs_gluon_triton
def test_gluon_kernels_overlap_softmax_with_the_tensor_cores(report):
    """The Hopper Gluon kernels leave a product in flight while the exponentials run (a wgmma wait
    with a group outstanding: P V in the forward, dP^T in the dK/dV backward), hand their warp
    partitions their registers (setmaxnreg), spill nothing (or the few scalars above) and fit the
    shared memory; the tl kernels, as Triton 3.6 compiles them, wait on every product."""
    gluon = {name: case for name, case in report.items() if name.startswith("gluon-")}
    assert gluon and any(name.startswith("gluon-bwd") for name in gluon)
    for name, case in gluon.items():
        assert case["async_wgmma_wait"] and case["setmaxnreg"], (name, case)
        assert case["spill_bytes"] <= GLUON_SPILL_BOUND.get(name, 0), (name, case)
    assert not any(case.get("async_wgmma_wait") for name, case in report.items() if name.startswith("fwd-"))


@needs_gluon_triton
def test_gluon_dkdv_kernels_take_their_row_statistics_by_tma(report):
    """The dK/dV kernel's consumers (every form, dQ fused or not) read delta and lse from shared memory, where the
    producer's TMA put them with each Q and dO tile: no global load waits inside the query loop. Dense, no global
    load at all; varlen, only its sequence's offsets, before any loop."""
    dkdv = {name: case for name, case in report.items() if name.startswith(("gluon-bwd_dkdv", "gluon-bwd_fused"))}
    assert dkdv and any("-varlen" in name for name in dkdv)
    loads = {name: (case["global_loads"], case["global_load_loop_depth"]) for name, case in dkdv.items()}
    assert all(count == 0 or ("-varlen" in name and depth == 0) for name, (count, depth) in loads.items()), loads


@needs_gluon_triton
def test_gluon_forward_partitions_share_the_register_file(report):
    """The forward's setmaxnreg split (flash_fwd_hopper.REGISTERS) by consumer count: two consumers of
    232 and a producer of 40, three of 160 and a producer of 32 (16 warps, the SM's 65536 registers)."""
    from flashformer.kernels.flash_fwd_hopper import REGISTERS
    for name, case in report.items():
        if name.startswith("gluon-fwd-"):
            consumer, producer = REGISTERS[3 if name.startswith("gluon-fwd-d64-c3-") else 2]
            assert {consumer, producer} <= set(case["setmaxnreg"]), (name, case)
    assert any(name.startswith("gluon-fwd-d64-c3-") for name in report)


@needs_gluon_triton
def test_gluon_consumers_take_turns_only_with_turns(report):
    """With TURNS each consumer waits for its turn before issuing its products and hands the turn on right after
    issuing them, before any wait (named barriers in registers, 256 threads), at every product issue: the opening S,
    each key tile's S and P V, the last P V. Only the forward takes turns, where the launcher asks
    (tuning.GLUON_TURNS: persistent, head_dim 128 and 64 with three consumers); in every other Gluon kernel no turn
    barrier is left in the PTX. Triton's own thread barriers keep ids below the turns' (hopper_ops.TURN_BARRIER)."""
    from hopper_compile import CASES  # here: it imports Triton's compiler, which CI's Triton may lack
    from flashformer.kernels.hopper_ops import TURN_BARRIER
    gluon = {name: case for name, case in report.items() if name.startswith("gluon-")}
    taking_turns = [name for name in gluon if CASES[name][1].get("TURNS")]
    assert len(taking_turns) >= 4 and all(name.startswith("gluon-fwd-") for name in taking_turns)
    for name, case in gluon.items():
        turns, well_formed = case["consumer_turns"]
        if name in taking_turns:
            assert turns >= 3 * CASES[name][1]["CONSUMERS"] and well_formed == turns, (name, case["consumer_turns"])
        else:
            assert turns == 0, (name, case["consumer_turns"])
        assert max(case["thread_barrier_ids"], default=0) < TURN_BARRIER.value, (name, case["thread_barrier_ids"])


# The persistent forward beside the one-tile kernel of the same shape.
PERSISTENT_FORWARD = {"gluon-fwd-d128-persistent-causal": "gluon-fwd-d128-causal",
                      "gluon-fwd-d128-persistent-causal-in-turn": "gluon-fwd-d128-causal",
                      "gluon-fwd-d128-persistent-full": "gluon-fwd-d128-full",
                      "gluon-fwd-d64-c3-persistent-full": "gluon-fwd-d64-c3-causal",
                      "gluon-fwd-d64-c3-persistent-full-in-turn": "gluon-fwd-d64-c3-causal",
                      "gluon-fwd-d64-c2-persistent-window-softcap-gqa-in-turn":
                          "gluon-fwd-d64-c2-window-softcap-gqa",
                      "gluon-fwd-d256-persistent-causal": "gluon-fwd-d256"}


def test_persistent_gluon_forward_loops_over_tiles(report):
    """Each program of the persistent forward runs many tiles: one loop more encloses its TMA loads (the
    producer's Q blocks, in the one-tile kernel inside only the warp partitions' dispatch loop) and its
    TMA stores of O (in the one-tile kernel, consumer 0's is in no loop) than in the one-tile kernel."""
    for persistent, one_tile in PERSISTENT_FORWARD.items():
        for depth in ("tma_load_loop_depth", "tma_store_loop_depth"):
            assert report[persistent][depth] == report[one_tile][depth] + 1, (persistent, one_tile, depth)
        assert report[one_tile]["tma_store_loop_depth"] == 0, report[one_tile]


def test_persistent_gluon_forward_overlaps_its_output_store(report):
    """With two sets of Q blocks a persistent consumer's output store overlaps products: issued while the next
    tile's first S is in flight (tiles overlapped at their boundaries: one store per consumer), or, tiles in turn,
    waited for once the next tile's first product is issued. With one set (head_dim 256) and in the one-tile
    kernel every store is waited for before any other product, and none is issued under one."""
    for persistent, one_tile in PERSISTENT_FORWARD.items():
        case = report[persistent]
        if persistent.startswith("gluon-fwd-d256"):
            assert case["stores_drained_under_products"] == case["stores_under_products"] == 0, (persistent, case)
        elif persistent.endswith("-in-turn"):
            assert case["stores_drained_under_products"] >= 2, (persistent, case)
        else:
            consumers = 3 if "-c3-" in persistent else 2
            assert case["stores_under_products"] >= consumers, (persistent, case)
        assert report[one_tile]["stores_drained_under_products"] == report[one_tile]["stores_under_products"] == 0


@needs_gluon_triton
def test_fused_gluon_bwd_reduces_dq_shares_in_bulk(report):
    """The fused Gluon backward (flash_bwd_hopper.launch_fused) adds each consumer's dQ share with one TMA
    reduce-add through an fp32 descriptor, never with element-wise fp32 atomics, and no local memory in
    its PTX; ordered (deterministic) it acquires and releases its semaphores, unordered it does not. The
    two-kernel dK/dV kernel reduces nothing. Both forms at head_dim 64 and 128, causal and not."""
    fused = {name: case for name, case in report.items() if name.startswith("gluon-bwd_fused")}
    shapes = {(name.startswith("gluon-bwd_fused_unordered"), name.split("-")[2], "causal" in name) for name in fused}
    assert shapes >= {(unordered, d, causal) for unordered in (False, True) for d in ("d64", "d128")
                      for causal in (False, True)}, shapes
    for name, case in fused.items():
        assert case["tma_reduce_add"] and case["f32_tensor_map"], (name, case)
        assert case["f32_global_atomics"] == 0 and not case["local_memory"], (name, case)
        assert case["shared_bytes"] <= 227 * 1024, (name, case)
        assert case["acquire_release"] == (not name.startswith("gluon-bwd_fused_unordered")), (name, case)
    dkdv = {name: case for name, case in report.items() if name.startswith("gluon-bwd_dkdv")}
    assert dkdv and not any(case["tma_reduce"] or case["acquire_release"] for case in dkdv.values()), dkdv


@needs_gluon_triton
def test_split_fused_gluon_bwd_halves_the_dq_stages(report):
    """DQ_SPLIT (flash_bwd_hopper.launch_fused(split_dq=True)): both consumers read both dS^T tiles and each
    adds half of dQ's columns, so its fp32 stage is half as wide: the shared memory is the share form's less
    two half stages (64 x head_dim_pad / 2 fp32 each) plus its two mbarriers at most, at head_dim 64 and
    128, ordered and unordered, causal and not, with the share form's PTX checks (test above)."""
    split = {name: case for name, case in report.items() if name.startswith("gluon-bwd_fused") and "split" in name}
    shapes = {(name.startswith("gluon-bwd_fused_unordered"), name.split("-")[2], "causal" in name) for name in split}
    assert shapes >= {(unordered, d, causal) for unordered in (False, True) for d in ("d64", "d128")
                      for causal in (False, True)}, shapes
    share_bytes = {name.split("-")[2]: case["shared_bytes"] for name, case in report.items()
                   if name.startswith("gluon-bwd_fused") and "split" not in name}
    for name, case in split.items():
        head_dim_pad = {"d64": 64, "d80": 128, "d128": 128}[name.split("-")[2]]
        saved = share_bytes[name.split("-")[2]] - case["shared_bytes"]
        assert 2 * 64 * head_dim_pad // 2 * 4 - 64 <= saved <= 2 * 64 * head_dim_pad // 2 * 4, (name, saved)


def test_cache_append_moves_16_bytes_per_access(report):
    """The append kernel copies each thread's 8 bf16 elements of a row with one 16-byte load and store: 4 of each
    per tensor at 32 rows x head_dim 128 over 128 threads, beside the length's load and one block_table load per
    row the thread holds (13 in all). Element-wise copies would take 32 loads per tensor. The packed form's rows
    find their sequences by a search of cu_seqlens (one load in its loop) and copy the same way. Rotary, either
    layout, loads each half (or the row, split in registers) and the cos / sin rows in 16-byte runs too: 17 loads,
    where partners and angles gathered element by element took 105."""
    for name, most in (("paged", 16), ("packed", 16), ("rotary", 20), ("rotary-interleaved", 20)):
        case = report[f"cache_append-d128-{name}"]
        assert case["global_loads"] <= most and case["spill_bytes"] == 0, (name, case)
