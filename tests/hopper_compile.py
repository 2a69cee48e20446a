"""Compile our Triton kernels for Hopper (sm_90) on a machine without a GPU; print a JSON report.

Triton's wheel carries ptxas, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs on
CPU. Run as a child process without TRITON_INTERPRET (under the interpreter triton.jit returns
interpreted functions, which cannot be compiled).
"""

import contextlib
import io
import json
import re
import sys

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton.experimental.gluon._runtime import GluonASTSource

from flashformer.kernels import (bwd_stats, cache_append, cross_entropy, decode_kernels, flash_bwd,
                                 flash_bwd_dq_hopper, flash_bwd_hopper, flash_fwd, flash_fwd_hopper, tuning)
from flashformer.kernels.interface import GLUON_TRITON_VERSIONS
from flashformer.kernels.sizes import pad_head_dim
from flashformer.kernels.tile_schedule import q_buffers

FP32_POINTERS = {"LSE", "DELTA", "LSE_LOG2", "DLSE", "LSE_PART", "O_PART", "DQ_ACC", "LOSSES", "TOKEN_SCALE",
                 "ALIBI_SLOPES", "COS", "SIN"}
INT64_POINTERS = {"TARGETS", "DROPOUT_SEED"}
INT32_POINTERS = {"CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQLENS_K", "BLOCK_TABLE", "DQ_SEMAPHORES", "TILE_SCHEDULE",
                  "STARTS", "CACHE_BATCH_IDX", "CU_SEQLENS", "SEQLENS_OUT"}
TMA_LOAD = r"cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global"
TMA_STORE = r"cp\.async\.bulk\.tensor\.\w+\.global\.shared"
FLOAT_SCALARS = {"qk_scale", "softcap_log2", "softmax_scale", "softcap", "dropout_rescale"}


def compile_for_hopper(kernel, constexprs, num_warps, num_stages, maxnreg=None, dtype="bf16"):
    """Compile ``kernel`` (a tl or a Gluon kernel) for sm_90 with the given constexprs; pointers named
    in CAPS, other args i32. Returns the compiled kernel and its ptxas -v log."""
    names = kernel.arg_names
    signature, constants, attrs = {}, {}, {}
    # What a launch on aligned tensors specialises (Triton's 16-divisibility of pointers and of ints): pointers,
    # and the strides of tensors whose rows are 16-element multiples. Without it pointer loads compile scalar and
    # unpipelined, unlike on the GPU; arguments a kernel keeps unspecialised stay so.
    unspecialised = {names[i] if isinstance(i, int) else i
                     for i in (*kernel.do_not_specialize, *kernel.do_not_specialize_on_alignment)}
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
        elif name.isupper():
            signature[name] = ("*fp32" if name in FP32_POINTERS else "*i32" if name in INT32_POINTERS
                               else "*i64" if name in INT64_POINTERS else f"*{dtype}")
        else:
            signature[name] = "fp32" if name in FLOAT_SCALARS else "i32"
        if (name.isupper() or name.startswith("stride_")) and name not in constexprs and name not in unspecialised:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source_type = GluonASTSource if kernel.is_gluon() else ASTSource
    source = source_type(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    # Triton runs ptxas -v itself and prints its log under dump_ptxas_log: read there, the registers and
    # spills cost no second ptxas run. always_compile: a kernel from Triton's cache would print no log.
    ptxas_log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(ptxas_log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg})
    return compiled, ptxas_log.getvalue()


def resource_usage(ptxas_log):
    """Registers per thread and spilled bytes, from the log of the ptxas -v that compiled the kernel."""
    registers = int(re.search(r"Used (\d+) registers", ptxas_log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    return registers, spills


def loop_depths(ptx, pattern):
    """How many loops enclose each PTX line matching ``pattern``: a loop spans from a label to the last
    branch back to it (the blocks LLVM places before a loop's header are missed)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__BB\d+_\d+):", line))}
    last_back_branch = {}
    for i, line in enumerate(lines):
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if target and labels.get(target.group(1), i) < i:
            last_back_branch[target.group(1)] = i
    spans = [(labels[label], end) for label, end in last_back_branch.items()]
    return [sum(start < i < end for start, end in spans) for i, line in enumerate(lines) if re.search(pattern, line)]


def stores_waited_under_products(ptx):
    """Of the TMA stores in the PTX, how many are followed by a wgmma group's issue before the next wait for
    bulk stores (``cp.async.bulk.wait_group.read``): a store left to drain under the products that follow."""
    events = re.findall(rf"({TMA_STORE})|(wgmma\.commit_group)|(cp\.async\.bulk\.wait_group\.read)", ptx)
    drained, store_open, product_since = 0, False, False
    for store, product, wait in events:
        if store:
            store_open, product_since = True, False
        elif product:
            product_since = store_open
        elif wait and store_open:
            drained += product_since
            store_open = False
    return drained


def stores_under_products(ptx):
    """Of the TMA stores in the PTX, how many are issued while a wgmma group is in flight (committed, and not yet
    waited for by a wait that leaves fewer groups outstanding): a store that overlaps a product."""
    events = re.findall(rf"({TMA_STORE})|(wgmma\.commit_group)|wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    overlapped, outstanding = 0, 0
    for store, product, wait in events:
        if store:
            overlapped += outstanding > 0
        elif product:
            outstanding += 1
        else:
            outstanding = min(outstanding, int(wait))
    return overlapped


def attention_constexprs(head_dim, block_m, block_n, causal=True, window=False, softcap=False, varlen=False, group=1,
                         accumulate_dq=False, has_dlse=False, alibi=False, dropout=False, paged=False):
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_head_dim(head_dim), BLOCK_M=block_m,
                BLOCK_N=block_n, LEFT_BOUNDED=window, RIGHT_BOUNDED=causal or window, HAS_SOFTCAP=softcap,
                IS_VARLEN=varlen, SEQS_PAD=16 if varlen else 1, ACCUMULATE_DQ=accumulate_dq,
                DQ_TMA_REDUCE=accumulate_dq, DOT_PRECISION="tf32", UPCAST_DOT=False, HAS_DLSE=has_dlse,
                ONE_LOOP=not accumulate_dq and pad_head_dim(head_dim) >= flash_bwd.ONE_LOOP_DKDV_HEAD_DIM,
                HAS_ALIBI=alibi, HAS_DROPOUT=dropout, IS_PAGED=paged)


def decode_constexprs(**changes):
    """decode_kernel's constexprs at head_dim 128, GQA 4:1, a paged cache, split, per-sequence lengths."""
    return dict(GROUP=4, GROUP_PAD=4, BLOCK_T=16, BLOCK_N=64, PAGE_SIZE=256, HEAD_DIM=128, HEAD_DIM_PAD=128,
                LEFT_BOUNDED=False, RIGHT_BOUNDED=True, HAS_SOFTCAP=False, HAS_ALIBI=False, SPLIT=True,
                PER_SEQUENCE_LENGTHS=True, VARLEN_Q=False, DOT_PRECISION="tf32", UPCAST_DOT=False) | changes


def append_constexprs(paged=False, packed=False, rotary=0):
    """rows_kernel's constexprs at head_dim 128 for k and v (per-sequence starts), rotated over all of head_dim."""
    return dict(ROWS=cache_append.ROWS, HEAD_DIM=128, HEAD_DIM_PAD=128, PAGED=paged, HAS_BATCH_IDX=False,
                PER_SEQUENCE_START=True, HAS_SECOND=True, ROTARY=rotary, ROTARY_HALF=64 if rotary else 0,
                ROTARY_HALF_PAD=64 if rotary else 1, AT_CACHE_POSITION=True, ROTATE_PER_TOKEN=True, PACKED=packed,
                WRITE_SEQLENS=packed)


def gluon_forward_constexprs(head_dim, causal=True, window=False, softcap=False, group=1, config=None,
                             persistent=False, overlap_tiles=True, turns=None, varlen=False):
    """config: (BLOCK_N, NUM_STAGES, CONSUMERS), tuning.GLUON_FORWARD_CONFIGS' by default; persistent: one program
    per SM with the Q buffers the launcher gives it, its tile boundaries overlapped where two sets fit
    (overlap_tiles=False: never; the launcher picks by length, tuning.gluon_overlaps_tiles); turns: the consumers
    issue their products in rotation (None: where the launcher has them, tuning.gluon_consumers_take_turns)."""
    head_dim_pad = pad_head_dim(head_dim)
    block_n, num_stages, consumers = config or tuning.GLUON_FORWARD_CONFIGS[head_dim_pad]
    q_smem, kv_smem = flash_fwd_hopper.shared_layouts(block_n, head_dim_pad, torch.bfloat16)
    q_sets = q_buffers(2 * num_stages * block_n, consumers * flash_fwd_hopper.CONSUMER_ROWS.value, head_dim_pad, 2)
    if turns is None:
        turns = tuning.gluon_consumers_take_turns(head_dim_pad, consumers, persistent)
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, CONSUMERS=consumers,
                BLOCK_N=block_n, NUM_STAGES=num_stages, LEFT_BOUNDED=window, RIGHT_BOUNDED=causal or window,
                HAS_SOFTCAP=softcap, PERSISTENT=persistent, Q_SMEM=q_smem, KV_SMEM=kv_smem,
                Q_BUFFERS=q_sets if persistent else 1,
                OVERLAP_TILES=overlap_tiles and persistent and q_sets == 2, TURNS=consumers if turns else 0,
                IS_VARLEN=varlen, SEQS_PAD=16 if varlen else 1)


def gluon_backward_constexprs(head_dim, causal=True, window=False, softcap=False, group=1, block_m=None,
                              dq_mode=flash_bwd_hopper.DQ_SEPARATE.value, split_dq=False, varlen=False):
    """dq_mode: flash_bwd_hopper's DQ_MODE; a fused one (dQ formed in the kernel) takes FUSED_BLOCK_M;
    split_dq: its DQ_SPLIT."""
    head_dim_pad = pad_head_dim(head_dim)
    default_m, num_stages = flash_bwd_hopper.config(head_dim_pad, 1.0 if softcap else 0.0)
    if dq_mode != flash_bwd_hopper.DQ_SEPARATE.value:
        default_m = flash_bwd_hopper.FUSED_BLOCK_M
    block_m = block_m or default_m
    qo_smem, qo_tma, kv_smem = flash_bwd_hopper.shared_layouts(block_m, head_dim_pad, torch.bfloat16)
    ds_smem, dq_smem, dq_tma = flash_bwd_hopper.fused_layouts(block_m, head_dim_pad, torch.bfloat16, split_dq)
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m,
                BLOCK_N=flash_bwd_hopper.block_n(head_dim_pad), NUM_STAGES=num_stages, LEFT_BOUNDED=window,
                RIGHT_BOUNDED=causal or window, HAS_SOFTCAP=softcap,
                SPLIT_HEAD_DIM=flash_bwd_hopper.split_head_dim(head_dim_pad), QO_SMEM=qo_smem, QO_TMA=qo_tma,
                KV_SMEM=kv_smem, DQ_MODE=dq_mode, DS_SMEM=ds_smem, DQ_SMEM=dq_smem, DQ_TMA=dq_tma,
                DQ_SPLIT=split_dq, IS_VARLEN=varlen, SEQS_PAD=16 if varlen else 1)


def gluon_dq_constexprs(head_dim, causal=True, window=False, softcap=False, group=1, varlen=False):
    head_dim_pad = pad_head_dim(head_dim)
    block_n = flash_bwd_dq_hopper.DQ_BLOCK_N[head_dim_pad]
    q_smem, _, _ = flash_bwd_hopper.shared_layouts(64, head_dim_pad, torch.bfloat16)
    _, kv_smem = flash_fwd_hopper.shared_layouts(block_n, head_dim_pad, torch.bfloat16)
    return dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=flash_bwd_dq_hopper.DQ_BLOCK_M,
                BLOCK_N=block_n, NUM_STAGES=flash_bwd_dq_hopper.DQ_NUM_STAGES, LEFT_BOUNDED=window,
                RIGHT_BOUNDED=causal or window, HAS_SOFTCAP=softcap, Q_SMEM=q_smem, KV_SMEM=kv_smem,
                IS_VARLEN=varlen, SEQS_PAD=16 if varlen else 1)


GLUON_FORWARD = flash_fwd_hopper._attn_fwd_hopper_kernel
GLUON_DQ = flash_bwd_dq_hopper._attn_bwd_dq_hopper_kernel
GLUON_DKDV = flash_bwd_hopper._attn_bwd_dkdv_hopper_kernel
GLUON_WARPS = flash_fwd_hopper.CONSUMER_WARPS.value
ORDERED, UNORDERED = flash_bwd_hopper.DQ_ORDERED.value, flash_bwd_hopper.DQ_UNORDERED.value
CASES = {
    "gluon-fwd-d128-causal": (GLUON_FORWARD, gluon_forward_constexprs(128), flash_fwd_hopper.CONSUMER_WARPS.value, 1),
    "gluon-fwd-d128-full": (GLUON_FORWARD, gluon_forward_constexprs(128, causal=False), flash_fwd_hopper.CONSUMER_WARPS.value, 1),
    "gluon-fwd-d64-c2-window-softcap-gqa": (GLUON_FORWARD, gluon_forward_constexprs(64, window=True, softcap=True,
                                                                                   group=4, config=(128, 2, 2)),
                                            GLUON_WARPS, 1),
    "gluon-fwd-d80": (GLUON_FORWARD, gluon_forward_constexprs(80), flash_fwd_hopper.CONSUMER_WARPS.value, 1),
    "gluon-fwd-d256": (GLUON_FORWARD, gluon_forward_constexprs(256, causal=False), flash_fwd_hopper.CONSUMER_WARPS.value, 1),
    # head_dim 64 with three consumer warpgroups (192 query rows: the default) and bench_gluon_forward's others
    "gluon-fwd-d64-c3-causal": (GLUON_FORWARD, gluon_forward_constexprs(64, config=(128, 2, 3)), GLUON_WARPS, 1),
    "gluon-fwd-d64-c3-window-softcap-gqa": (GLUON_FORWARD, gluon_forward_constexprs(64, window=True, softcap=True,
                                                                                   group=4, config=(128, 3, 3)),
                                            GLUON_WARPS, 1),
    "gluon-fwd-d64-c3-full-n64": (GLUON_FORWARD, gluon_forward_constexprs(64, causal=False, config=(64, 4, 3)),
                                  GLUON_WARPS, 1),
    # packed sequences (varlen), one tile per program, at the head_dims that take it (128, 256)
    "gluon-fwd-d128-varlen-causal": (GLUON_FORWARD, gluon_forward_constexprs(128, varlen=True), GLUON_WARPS, 1),
    "gluon-fwd-d128-varlen-window-softcap-gqa": (
        GLUON_FORWARD, gluon_forward_constexprs(128, window=True, softcap=True, group=4, varlen=True), GLUON_WARPS, 1),
    "gluon-fwd-d256-varlen-full": (GLUON_FORWARD, gluon_forward_constexprs(256, causal=False, varlen=True),
                                   GLUON_WARPS, 1),
    # the persistent forward (one program per SM walking kernels/tile_schedule.py's order) at every head_dim
    "gluon-fwd-d128-persistent-causal": (GLUON_FORWARD, gluon_forward_constexprs(128, persistent=True), GLUON_WARPS, 1),
    "gluon-fwd-d128-persistent-full": (GLUON_FORWARD, gluon_forward_constexprs(128, causal=False, persistent=True),
                                       GLUON_WARPS, 1),
    "gluon-fwd-d64-c3-persistent-full": (GLUON_FORWARD, gluon_forward_constexprs(64, causal=False, persistent=True),
                                         GLUON_WARPS, 1),
    # the persistent forward whose tiles run one after the other (launch_forward(overlap_tiles=False)): at head_dim
    # 64 with a right bound what the launcher runs
    "gluon-fwd-d64-c2-persistent-window-softcap-gqa-in-turn": (
        GLUON_FORWARD, gluon_forward_constexprs(64, window=True, softcap=True, group=4, config=(128, 2, 2),
                                                persistent=True, overlap_tiles=False), GLUON_WARPS, 1),
    "gluon-fwd-d128-persistent-causal-in-turn": (
        GLUON_FORWARD, gluon_forward_constexprs(128, persistent=True, overlap_tiles=False), GLUON_WARPS, 1),
    "gluon-fwd-d64-c3-persistent-full-in-turn": (
        GLUON_FORWARD, gluon_forward_constexprs(64, causal=False, persistent=True, overlap_tiles=False), GLUON_WARPS, 1),
    # the persistent consumers at their own pace, where the launcher has them take turns (TURNS)
    "gluon-fwd-d128-persistent-causal-own-pace": (
        GLUON_FORWARD, gluon_forward_constexprs(128, persistent=True, turns=False), GLUON_WARPS, 1),
    "gluon-fwd-d256-persistent-causal": (GLUON_FORWARD, gluon_forward_constexprs(256, persistent=True), GLUON_WARPS, 1),
    "gluon-fwd-d256-persistent-full": (GLUON_FORWARD, gluon_forward_constexprs(256, causal=False, persistent=True),
                                       GLUON_WARPS, 1),
    # every Gluon backward configuration (flash_bwd_hopper.config): head_dim 64, 128, 256 (split), softcap's tile
    "gluon-bwd_dkdv-d128-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(128, group=4), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d128-full": (GLUON_DKDV, gluon_backward_constexprs(128, causal=False), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d128-window-softcap": (GLUON_DKDV, gluon_backward_constexprs(128, window=True, softcap=True),
                                           GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d80-window": (GLUON_DKDV, gluon_backward_constexprs(80, window=True, group=2), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d256-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(256, group=2), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d256-full-softcap": (GLUON_DKDV, gluon_backward_constexprs(256, causal=False, softcap=True),
                                         GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d192-window": (GLUON_DKDV, gluon_backward_constexprs(192, window=True), GLUON_WARPS, 1),
    # the dK/dV kernel that also forms dQ (launch_fused), ordered (deterministic) and unordered
    "gluon-bwd_fused-d128-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(128, group=4, dq_mode=ORDERED),
                                        GLUON_WARPS, 1),
    "gluon-bwd_fused-d128-full": (GLUON_DKDV, gluon_backward_constexprs(128, causal=False, dq_mode=ORDERED),
                                  GLUON_WARPS, 1),
    "gluon-bwd_fused-d64-causal": (GLUON_DKDV, gluon_backward_constexprs(64, dq_mode=ORDERED), GLUON_WARPS, 1),
    "gluon-bwd_fused-d64-full-gqa": (GLUON_DKDV, gluon_backward_constexprs(64, causal=False, group=2,
                                                                           dq_mode=ORDERED), GLUON_WARPS, 1),
    "gluon-bwd_fused-d64-window-softcap-gqa": (GLUON_DKDV, gluon_backward_constexprs(64, window=True, softcap=True,
                                                                                     group=2, dq_mode=ORDERED),
                                               GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered-d80-window": (GLUON_DKDV, gluon_backward_constexprs(80, window=True, dq_mode=UNORDERED),
                                             GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered-d128-causal": (GLUON_DKDV, gluon_backward_constexprs(128, dq_mode=UNORDERED),
                                              GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered-d128-full-gqa": (GLUON_DKDV, gluon_backward_constexprs(128, causal=False, group=4,
                                                                                      dq_mode=UNORDERED),
                                                GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered-d64-causal": (GLUON_DKDV, gluon_backward_constexprs(64, dq_mode=UNORDERED),
                                             GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered-d64-full": (GLUON_DKDV, gluon_backward_constexprs(64, causal=False,
                                                                                 dq_mode=UNORDERED), GLUON_WARPS, 1),
    # the same with the consumers' dS^T shared and dQ's columns split between them (DQ_SPLIT)
    "gluon-bwd_fused_split-d128-causal": (GLUON_DKDV, gluon_backward_constexprs(128, dq_mode=ORDERED, split_dq=True),
                                          GLUON_WARPS, 1),
    "gluon-bwd_fused_split-d128-full-gqa": (GLUON_DKDV, gluon_backward_constexprs(128, causal=False, group=4,
                                                                                  dq_mode=ORDERED, split_dq=True),
                                            GLUON_WARPS, 1),
    "gluon-bwd_fused_split-d64-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(64, group=2, dq_mode=ORDERED,
                                                                                   split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_fused_split-d64-full": (GLUON_DKDV, gluon_backward_constexprs(64, causal=False, dq_mode=ORDERED,
                                                                             split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_fused_split-d64-window-softcap-gqa": (
        GLUON_DKDV, gluon_backward_constexprs(64, window=True, softcap=True, group=2, dq_mode=ORDERED, split_dq=True),
        GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered_split-d128-causal-gqa": (
        GLUON_DKDV, gluon_backward_constexprs(128, group=4, dq_mode=UNORDERED, split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered_split-d128-full": (
        GLUON_DKDV, gluon_backward_constexprs(128, causal=False, dq_mode=UNORDERED, split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered_split-d64-causal": (
        GLUON_DKDV, gluon_backward_constexprs(64, dq_mode=UNORDERED, split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered_split-d64-full-gqa": (
        GLUON_DKDV, gluon_backward_constexprs(64, causal=False, group=2, dq_mode=UNORDERED, split_dq=True),
        GLUON_WARPS, 1),
    "gluon-bwd_fused_unordered_split-d80-window": (
        GLUON_DKDV, gluon_backward_constexprs(80, window=True, dq_mode=UNORDERED, split_dq=True), GLUON_WARPS, 1),
    "gluon-bwd_dq-d128-causal-gqa": (GLUON_DQ, gluon_dq_constexprs(128, group=4), GLUON_WARPS, 1),
    "gluon-bwd_dq-d128-window-softcap": (GLUON_DQ, gluon_dq_constexprs(128, window=True, softcap=True), GLUON_WARPS, 1),
    "gluon-bwd_dq-d64-full": (GLUON_DQ, gluon_dq_constexprs(64, causal=False), GLUON_WARPS, 1),
    "gluon-bwd_dq-d64-softcap-gqa": (GLUON_DQ, gluon_dq_constexprs(64, softcap=True, group=2), GLUON_WARPS, 1),
    "gluon-bwd_dq-d256-causal": (GLUON_DQ, gluon_dq_constexprs(256), GLUON_WARPS, 1),
    "gluon-bwd_dq-d256-full-softcap": (GLUON_DQ, gluon_dq_constexprs(256, causal=False, softcap=True), GLUON_WARPS, 1),
    # packed sequences (varlen): the two kernels of the deterministic backward
    "gluon-bwd_dq-d128-varlen-causal-gqa": (GLUON_DQ, gluon_dq_constexprs(128, group=4, varlen=True), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d128-varlen-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(128, group=4, varlen=True),
                                              GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d64-varlen-window-softcap": (
        GLUON_DKDV, gluon_backward_constexprs(64, window=True, softcap=True, varlen=True), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d256-varlen-full": (GLUON_DKDV, gluon_backward_constexprs(256, causal=False, varlen=True),
                                        GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d64-causal-gqa": (GLUON_DKDV, gluon_backward_constexprs(64, group=4), GLUON_WARPS, 1),
    "gluon-bwd_dkdv-d64-window-softcap": (GLUON_DKDV, gluon_backward_constexprs(64, window=True, softcap=True),
                                          GLUON_WARPS, 1),
    "fwd-d128-causal": (flash_fwd._attn_fwd_kernel, attention_constexprs(128, 128, 64), 8, 3),
    "fwd-d64-window-softcap-gqa": (flash_fwd._attn_fwd_kernel,
                                   attention_constexprs(64, 128, 64, window=True, softcap=True, group=4), 4, 3),
    "fwd-d80-varlen": (flash_fwd._attn_fwd_kernel, attention_constexprs(80, 128, 64, varlen=True), 8, 3),
    "fwd-d256": (flash_fwd._attn_fwd_kernel, attention_constexprs(256, 64, 32, causal=False), 4, 2),
    # a prompt over paged keys (flash_attn_with_kvcache, flash_attn_varlen_func with block_table)
    "fwd-d128-paged-causal-gqa": (flash_fwd._attn_fwd_kernel,
                                  attention_constexprs(128, 128, 64, varlen=True, group=4, paged=True), 8, 3),
    "bwd_dkdv-d128-causal-gqa": (flash_bwd._bwd_dkdv_kernel, attention_constexprs(128, 32, 128, group=4), 8, 2),
    # the offline table's head_dim-64 causal config, compiled with no length divisible by 16
    "bwd_dkdv-d64-causal-ragged": (flash_bwd._bwd_dkdv_kernel, attention_constexprs(64, 64, 64), 4, 3),
    "bwd_dkdv-d64-varlen-softcap": (flash_bwd._bwd_dkdv_kernel,
                                    attention_constexprs(64, 64, 64, softcap=True, varlen=True), 4, 3),
    "bwd_fused-d128-causal-gqa": (flash_bwd._bwd_dkdv_kernel,
                                  attention_constexprs(128, 32, 128, group=4, accumulate_dq=True), 8, 2),
    "bwd_fused-d64-varlen": (flash_bwd._bwd_dkdv_kernel,
                             attention_constexprs(64, 64, 128, varlen=True, accumulate_dq=True), 8, 2),
    "bwd_dkdv-d256": (flash_bwd._bwd_dkdv_kernel, attention_constexprs(256, 32, 64, causal=False), 8, 2),
    # seqlen_q == 1 arrives as a constant (Triton specialises 1) and folds the query loops away; the
    # software pipeliner then took the GQA loop, whose descriptor creation it cannot predicate.
    "bwd_dkdv-gqa-one-query": (flash_bwd._bwd_dkdv_kernel,
                               dict(attention_constexprs(64, 32, 128, causal=False, group=2), seqlen_q=1), 8, 2),
    "bwd_fused-gqa-one-query": (flash_bwd._bwd_dkdv_kernel,
                                dict(attention_constexprs(64, 32, 128, causal=False, group=2, accumulate_dq=True),
                                     seqlen_q=1), 8, 2),
    "bwd_dq-d128-causal": (flash_bwd._bwd_dq_kernel, attention_constexprs(128, 128, 64, has_dlse=True), 8, 2),
    # ALiBi and dropout (Philox per element) in every kernel family and dK/dV loop shape
    "fwd-d128-causal-alibi-dropout": (flash_fwd._attn_fwd_kernel,
                                      attention_constexprs(128, 128, 64, alibi=True, dropout=True), 8, 3),
    "fwd-d64-varlen-dropout": (flash_fwd._attn_fwd_kernel, attention_constexprs(64, 128, 64, varlen=True, dropout=True),
                               4, 3),
    "bwd_dkdv-d128-gqa-alibi-dropout": (flash_bwd._bwd_dkdv_kernel,
                                        attention_constexprs(128, 32, 128, group=4, alibi=True, dropout=True), 8, 2),
    "bwd_dkdv-d64-three-loops-alibi-dropout": (flash_bwd._bwd_dkdv_kernel,
                                               attention_constexprs(64, 32, 128, alibi=True, dropout=True), 8, 2),
    "bwd_fused-d64-alibi-dropout": (flash_bwd._bwd_dkdv_kernel,
                                    attention_constexprs(64, 64, 128, accumulate_dq=True, alibi=True, dropout=True), 8, 2),
    "bwd_dq-d128-alibi-dropout": (flash_bwd._bwd_dq_kernel,
                                  attention_constexprs(128, 128, 64, alibi=True, dropout=True), 8, 2),
    # the register-capped candidates of kernels/tuning.py (two programs per SM)
    "fwd-d128-two-per-sm": (flash_fwd._attn_fwd_kernel, attention_constexprs(128, 128, 64), 8, 2, 128),
    "bwd_dq-d128-two-per-sm": (flash_bwd._bwd_dq_kernel, attention_constexprs(128, 128, 32), 8, 2, 128),
    "bwd_dq-d256": (flash_bwd._bwd_dq_kernel, attention_constexprs(256, 64, 32, causal=False), 8, 2),
    "bwd_dq-d64-window": (flash_bwd._bwd_dq_kernel, attention_constexprs(64, 64, 64, window=True), 4, 3),
    "bwd_preprocess-d128": (bwd_stats._bwd_preprocess,
                            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK=64, IS_VARLEN=False, SEQS_PAD=1,
                                 HAS_DLSE=True), 4, 1),
    "decode-d128-gqa4-paged": (decode_kernels.decode_kernel, decode_constexprs(), 4, 3),
    # flash_attn_varlen_func's paged form: packed queries
    "decode-d128-gqa4-paged-varlen": (decode_kernels.decode_kernel, decode_constexprs(VARLEN_Q=True), 4, 3),
    "decode-d128-gqa4-paged-alibi": (decode_kernels.decode_kernel, decode_constexprs(HAS_ALIBI=True), 4, 3),
    "cache_append-d128-paged": (cache_append.rows_kernel, append_constexprs(paged=True), 4, 1),
    "cache_append-d128-packed": (cache_append.rows_kernel, append_constexprs(paged=True, packed=True), 4, 1),
    "cache_append-d128-rotary": (cache_append.rows_kernel, append_constexprs(rotary=cache_append.HALVES), 4, 1),
    "cache_append-d128-rotary-interleaved": (cache_append.rows_kernel,
                                             append_constexprs(rotary=cache_append.INTERLEAVED), 4, 1),
    "cross_entropy_fwd": (cross_entropy._ce_forward_kernel, dict(BLOCK_V=4096, HAS_BIAS=True, HAS_SOFTCAP=True), 8, 3),
    "cross_entropy_bwd": (cross_entropy._ce_backward_kernel, dict(BLOCK_V=4096, HAS_BIAS=True, HAS_SOFTCAP=True), 8, 3),
}


def consumer_turns(ptx):
    """(turns, well formed) of the consumers' turns on the tensor cores (hopper_ops.wait_turn): the
    256-thread bar.sync on a named barrier in a register, and how many of them reach the next such bar.arrive
    through at least one wgmma issue and no wgmma wait (the turn covers issuing the products, not their wait)."""
    lines = ptx.splitlines()
    starts = [i for i, line in enumerate(lines) if re.search(r"\bbar\.sync %r\d+, 256;", line)]
    well_formed = 0
    for start in starts:
        end = next((i for i in range(start + 1, len(lines)) if re.search(r"\bbar\.arrive %r\d+, 256;", lines[i])),
                   None)
        body = lines[start:end] if end is not None else []
        well_formed += any("wgmma.mma_async" in line for line in body) and not any("wgmma.wait_group" in line
                                                                                 for line in body)
    return len(starts), well_formed


def cases_to_compile():
    """The names of the CASES this Triton runs. The Gluon kernels run only on the Triton versions they were tested
    on (interface.hopper_gluon_available): on another Triton the tl kernels take their place, so only those must
    compile."""
    gluon_runs = triton.__version__.startswith(GLUON_TRITON_VERSIONS)
    return [name for name in CASES if gluon_runs or not name.startswith("gluon-")]


def main(selected):
    report = {}
    for name in selected or cases_to_compile():
        kernel, constexprs, *options = CASES[name]
        try:
            compiled, ptxas_log = compile_for_hopper(kernel, constexprs, *options)
        except Exception as error:  # report every case, then let the test say which failed
            report[name] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
            continue
        ptx = compiled.asm["ptx"]
        registers, spill_bytes = resource_usage(ptxas_log)
        report[name] = {"wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
                        "tma_reduce": "cp.reduce.async.bulk.tensor" in ptx,
                        # a TMA reduce-add, and a descriptor of fp32 elements (tensor map type 7) for it
                        "tma_reduce_add": bool(re.search(r"cp\.reduce\.async\.bulk\.tensor\.[\w:.]*\.add\b", ptx)),
                        "f32_tensor_map": bool(re.search(r"tensormap\.replace\.tile\.elemtype\S*\s[^;]*,\s*0x7;",
                                                         ptx)),
                        # element-wise fp32 adds (atom or red, any scope, vector or not; the semaphores' are u32)
                        "f32_global_atomics": sum(".add" in op and "f32" in op
                                                  for op in re.findall(r"\b(?:atom|red)\.[\w.:]+", ptx)),
                        # the ordering of DQ_ORDERED: acquire-loads of the semaphore, release-adds to it
                        "acquire_release": "ld.acquire.gpu" in ptx and "atom.release.gpu" in ptx,
                        # loads through the load/store units from global memory (TMA copies are not among them)
                        "global_loads": len(re.findall(r"\bld\.global\b", ptx)),
                        "global_load_loop_depth": max(loop_depths(ptx, r"\bld\.global\b"), default=0),
                        # asynchronous copies from global to shared memory (Ampere's, a pipelined pointer load)
                        "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global\b", ptx)),
                        # local memory in the PTX itself (ptxas's own spills are spill_bytes)
                        "local_memory": bool(re.search(r"\b(?:ld|st)\.local\b", ptx)),
                        # wgmma.wait_group N with N >= 1: a product left in flight while the program goes on
                        "async_wgmma_wait": bool(re.search(r"wgmma\.wait_group\.sync\.aligned [1-9]", ptx)),
                        # the register counts the partitions ask for (empty: no setmaxnreg)
                        "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                         ptx)}),
                        # the fewest loops around a TMA load / store: a persistent kernel's tile loop adds one
                        "tma_load_loop_depth": min(loop_depths(ptx, TMA_LOAD), default=None),
                        "tma_store_loop_depth": min(loop_depths(ptx, TMA_STORE), default=None),
                        "stores_drained_under_products": stores_waited_under_products(ptx),
                        "stores_under_products": stores_under_products(ptx),
                        # Triton's own thread barriers (immediate ids) and the consumers' turns (register ids)
                        "thread_barrier_ids": sorted({int(n) for n in re.findall(r"\bbar\.(?:sync|arrive)\s+(\d+)",
                                                                                 ptx)}),
                        "consumer_turns": consumer_turns(ptx),
                        "shared_bytes": compiled.metadata.shared, "registers": registers, "spill_bytes": spill_bytes}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
