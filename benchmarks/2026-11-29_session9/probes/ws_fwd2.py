"""Experiment: causal forward under Hopper WS without make_range(start != 0) in the consumers."""
import itertools, json, os, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_tile(q, k, v, row_max, row_sum, acc, qk_scale, keep, MASKED: tl.constexpr):
    s = tl.dot(q, k.T)
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - new_max[:, None])
    alpha = tl.exp2(row_max - new_max)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return new_max, row_sum, acc


@triton.jit
def _fwd_v(Q, K, V, O, LSE, ROW_IDS, stride_b, stride_s, stride_h, seqlen, qk_scale,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """MODE 1: mask every tile, rows from a TMA load of ROW_IDS; 2: unmasked WS loop, then the diagonal
    tile after the loop (rows from ROW_IDS); 3: like 2 with rows from make_range (the suspect); 4: runtime
    branch in the loop."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    off = batch * stride_b + head * stride_h
    q_desc = tl.make_tensor_descriptor(Q + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    lse_desc = tl.make_tensor_descriptor(LSE + (batch * tl.num_programs(1) + head) * seqlen, [seqlen], [1], [BLOCK_M])
    m0 = pid * BLOCK_M
    q = q_desc.load([m0, 0])
    if MODE == 3:
        rows = m0 + tl.arange(0, BLOCK_M)
    else:
        rows = tl.make_tensor_descriptor(ROW_IDS, [seqlen], [1], [BLOCK_M]).load([m0])
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    if MODE == 1:
        for n0 in tl.range(0, m0 + BLOCK_M, BLOCK_N, warp_specialize=True):
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
            row_max, row_sum, acc = _softmax_tile(q, k, v, row_max, row_sum, acc, qk_scale,
                                                  rows[:, None] >= (n0 + cols)[None, :], True)
    elif MODE == 4:
        for n0 in tl.range(0, m0 + BLOCK_M, BLOCK_N, warp_specialize=True):
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
            s = tl.dot(q, k.T)
            if n0 >= m0:
                s = tl.where(rows[:, None] >= (n0 + cols)[None, :], s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - new_max[:, None])
            alpha = tl.exp2(row_max - new_max)
            row_sum = row_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            row_max = new_max
    else:
        for n0 in tl.range(0, m0, BLOCK_N, warp_specialize=True):
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
            row_max, row_sum, acc = _softmax_tile(q, k, v, row_max, row_sum, acc, qk_scale, rows[:, None], False)
        for i in tl.static_range(BLOCK_M // BLOCK_N):
            n0 = m0 + i * BLOCK_N
            k = k_desc.load([n0, 0])
            v = v_desc.load([n0, 0])
            row_max, row_sum, acc = _softmax_tile(q, k, v, row_max, row_sum, acc, qk_scale,
                                                  rows[:, None] >= (n0 + cols)[None, :], True)
    acc = acc / row_sum[:, None]
    o_desc.store([m0, 0], acc.to(O.dtype.element_ty))
    lse_desc.store([m0], (row_max + tl.log2(row_sum)) * 0.6931471805599453)


def run(q, k, v, mode, bm, bn, w, st, row_ids):
    b, n, h, d = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n), float("nan"), device=q.device, dtype=torch.float32)
    _fwd_v[(n // bm, h, b)](q, k, v, o, lse, row_ids, q.stride(0), q.stride(1), q.stride(2), n, d ** -0.5 * LOG2E,
                            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=w, num_stages=st)
    return o, lse


def main():
    from flashformer.kernels import flash_attn_func
    from flashformer.kernels.launch import ensure_allocator
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = dev.type == "cpu"
    if quick:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    else:
        ensure_allocator(dev)
    dtype = torch.float16 if quick else torch.bfloat16
    bench = (lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) if not quick else (lambda fn: float("nan"))
    row_ids = torch.arange(1 << 16, device=dev, dtype=torch.int32)
    cells = [(32, 128, 1)] if quick else [(d, s, 16384 // s) for d in (128, 64) for s in (1024, 4096, 16384)]
    cfgs = [(32, 16, 4, 2), (32, 32, 4, 2)] if quick else [(128, 128, 4, 2), (128, 64, 4, 2)]
    table = []
    for d, n, b in cells:
        h = 2 if quick else 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=dtype) for _ in range(3))
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
        base = (F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2).float() - ref).abs().max().item()
        s = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) * d ** -0.5
        lse_ref = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=dev).tril(), float("-inf")).logsumexp(-1)
        del s
        flops = 4 * b * h * n * n * d / 2
        row = {"d": d, "n": n}
        if not quick:
            row["ours"] = f"{flops / bench(lambda: flash_attn_func(q, k, v, causal=True)) / 1e9:.0f}"
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            row["cudnn"] = f"{flops / bench(cudnn) / 1e9:.0f}"
        for mode, (bm, bn, w, st) in itertools.product((1, 4), cfgs):
            name = f"m{mode}_{bm}x{bn}"
            try:
                o, lse = run(q, k, v, mode, bm, bn, w, st, row_ids)
                err = (o.float() - ref).abs().max().item()
                lerr = (lse - lse_ref).abs().max().item()
                bad = ((o.float() - ref).abs() > 2 * base + 1e-6).any(-1).any(-1).nonzero()
                ok = err <= 2 * base + 1e-6 and lerr < 1e-3
                row[name] = f"{flops / bench(lambda: run(q, k, v, mode, bm, bn, w, st, row_ids)) / 1e9:.0f}" + ("" if ok else f"!ERR{err:.2g},lse{lerr:.2g},row{bad[:1, 1].tolist()}")
            except Exception as e:
                row[name] = "fail:" + (str(e).strip().splitlines()[-1][:60] if str(e).strip() else repr(e)[:60])
            print(json.dumps({"d": d, "n": n, name: row[name]}), flush=True)
        table.append(row)
    names = list(dict.fromkeys(k2 for r in table for k2 in r))
    print("| " + " | ".join(names) + " |")
    for r in table:
        print("| " + " | ".join(str(r.get(k2, "")) for k2 in names) + " |")


if __name__ == "__main__":
    main()
