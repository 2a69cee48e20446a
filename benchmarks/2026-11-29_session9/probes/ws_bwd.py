"""Experiment: Hopper warp specialisation on one-loop backward kernels (dK/dV and dQ), and causal fwd diagnostics."""
import itertools, json, os, sys
import torch, triton, triton.language as tl
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

LOG2E = 1.4426950408889634


@triton.jit
def _ws_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, stride_b, stride_s, stride_h, seqlen, qk_scale, sm_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
             CAUSAL: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    off = batch * stride_b + head * stride_h
    row_off = (batch * tl.num_programs(1) + head) * seqlen
    q_desc = tl.make_tensor_descriptor(Q + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    dk_desc = tl.make_tensor_descriptor(DK + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    dv_desc = tl.make_tensor_descriptor(DV + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    n0 = pid * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = n0 if CAUSAL else 0
    for m0 in tl.range(lo, seqlen, BLOCK_M, warp_specialize=WS):
        q = q_desc.load([m0, 0])
        do = do_desc.load([m0, 0])
        rows = m0 + tl.arange(0, BLOCK_M)
        lse = tl.load(LSE2 + row_off + rows)
        delta = tl.load(DELTA + row_off + rows)
        st = tl.dot(k, q.T)
        pt = tl.exp2(st * qk_scale - lse[None, :])
        if CAUSAL:
            pt = tl.where(cols[:, None] <= rows[None, :], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, do.T)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk)
    dk_desc.store([n0, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    dv_desc.store([n0, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def _ws_dq(Q, K, V, DO, DQ, LSE2, DELTA, stride_b, stride_s, stride_h, seqlen, qk_scale, sm_scale,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
           CAUSAL: tl.constexpr):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    off = batch * stride_b + head * stride_h
    row_off = (batch * tl.num_programs(1) + head) * seqlen
    q_desc = tl.make_tensor_descriptor(Q + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DO + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    dq_desc = tl.make_tensor_descriptor(DQ + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    m0 = pid * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    q = q_desc.load([m0, 0])
    do = do_desc.load([m0, 0])
    # 1-D descriptors: pointer loads before the loop trip the WS pass (WSLowerToken assertion)
    lse = tl.make_tensor_descriptor(LSE2 + row_off, [seqlen], [1], [BLOCK_M]).load([m0])
    delta = tl.make_tensor_descriptor(DELTA + row_off, [seqlen], [1], [BLOCK_M]).load([m0])
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum(m0 + BLOCK_M, seqlen) if CAUSAL else seqlen
    for n0 in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        s = tl.dot(q, k.T)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if CAUSAL:
            p = tl.where(rows[:, None] >= (n0 + tl.arange(0, BLOCK_N))[None, :], p, 0.0)
        dp = tl.dot(do, v.T)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    dq_desc.store([m0, 0], (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _ws_fwd_diag(Q, K, V, O, stride_b, stride_s, stride_h, seqlen, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
                 MODE: tl.constexpr):
    """MODE 0: causal bound, no mask (prefix attention of keys [0, hi)); 1: causal, mask from a loop-carried
    column vector; 2: causal, additive bias from a compare against a loop-carried scalar."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    off = batch * stride_b + head * stride_h
    q_desc = tl.make_tensor_descriptor(Q + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O + off, [seqlen, HEAD_DIM], [stride_s, 1], [BLOCK_M, HEAD_DIM])
    m0 = pid * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    q = q_desc.load([m0, 0])
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    hi = tl.minimum(m0 + BLOCK_M, seqlen)
    for n0 in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([n0, 0])
        s = tl.dot(q, k.T)
        if MODE == 1:
            s = tl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - new_max[:, None])
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = v_desc.load([n0, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
        cols += BLOCK_N
    acc = acc / row_sum[:, None]
    o_desc.store([m0, 0], acc.to(O.dtype.element_ty))


def ws_backward(q, k, v, o, do, lse, causal, dkdv_cfg, dq_cfg, ws):
    b, n, h, d = q.shape
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    scale = d ** -0.5
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
    lse2 = (lse * LOG2E).contiguous()
    bm, bn, w, st = dkdv_cfg
    _ws_dkdv[(n // bn, h, b)](q, k, v, do, dk, dv, lse2, delta, q.stride(0), q.stride(1), q.stride(2), n,
                              scale * LOG2E, scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, WS=ws, CAUSAL=causal,
                              num_warps=w, num_stages=st)
    bm, bn, w, st = dq_cfg
    _ws_dq[(n // bm, h, b)](q, k, v, do, dq, lse2, delta, q.stride(0), q.stride(1), q.stride(2), n,
                            scale * LOG2E, scale, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, WS=ws, CAUSAL=causal,
                            num_warps=w, num_stages=st)
    return dq, dk, dv


def main():
    from flashformer.kernels import flash_attn_func
    from flashformer.kernels.flash_fwd import attention_forward
    from flashformer.kernels.launch import ensure_allocator
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = dev.type == "cpu"
    if quick:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    else:
        ensure_allocator(dev)
    dtype = torch.float16 if quick else torch.bfloat16
    bench = (lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) if not quick else (lambda fn: float("nan"))
    table = []
    # causal forward diagnostics
    for d, n, b in ([(32, 64, 1)] if quick else [(128, 1024, 16), (128, 4096, 4)]):
        h = 2 if quick else 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=dtype) for _ in range(3))
        for mode in (0, 1):
            if mode == 0:  # prefix attention per query tile
                bm = 32 if quick else 128
                keys = torch.arange(n, device=dev)
                tile_end = (torch.arange(n, device=dev) // bm + 1) * bm
                mask = keys[None, :] < tile_end[:, None]
            else:
                mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
            ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
            base = (F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2).float() - ref).abs().max().item()
            for bm, bn, w, st in ([(32, 16, 4, 2)] if quick else [(128, 128, 4, 2), (128, 64, 4, 2)]):
                o = torch.full_like(q, float("nan"))
                fn = lambda: _ws_fwd_diag[(n // bm, h, b)](q, k, v, o, q.stride(0), q.stride(1), q.stride(2), n, d ** -0.5 * LOG2E,
                                                         HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, WS=True, MODE=mode, num_warps=w, num_stages=st)
                try:
                    fn()
                    bad = ((o.float() - ref).abs() > 2 * base + 1e-6)
                    err = (o.float() - ref).abs().max().item()
                    where = bad.nonzero()[:, 1].unique()[:8].tolist() if bad.any() else []
                    line = f"fwd-diag mode {mode} d{d} n{n} {bm}x{bn}w{w}s{st}: err {err:.3g} (2x torch {2 * base:.3g}) bad rows(seq) {bad.any(-1).any(-1).sum().item()} first {where} tflops {4 * b * h * n * n * d / 2 / bench(fn) / 1e9:.0f}"
                except Exception as e:
                    line = f"fwd-diag mode {mode} d{d} {bm}x{bn}: fail {str(e).strip().splitlines()[-1][:100] if str(e).strip() else repr(e)}"
                print(line, flush=True)
    cells = [(32, 128, 1)] if quick else [(d, s, 16384 // s) for d in (128, 64) for s in (1024, 4096, 16384)]
    dkdv_cfgs = [(32, 64, 4, 2)] if quick else [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2)]
    dq_cfgs = [(64, 32, 4, 2)] if quick else [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3)]
    for (d, n, b), causal in itertools.product(cells, (True, False)):
        h = 2 if quick else 2048 // d
        q, k, v, do = (torch.randn(b, n, h, d, device=dev, dtype=dtype) for _ in range(4))
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal).transpose(1, 2).backward(do.float())
        refs = [t.grad for t in leaves]
        low = [t.detach().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in low), is_causal=causal).transpose(1, 2).backward(do)
        bases = [(t.grad.float() - r).abs().max().item() for t, r in zip(low, refs)]
        flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
        row = {"d": d, "n": n, "causal": causal}
        o, lse = attention_forward(q, k, v, d ** -0.5, -1, 0 if causal else -1, 0.0) if not quick else (None, None)
        if quick:
            o = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal).transpose(1, 2).to(dtype)
            s = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) * d ** -0.5
            if causal:
                s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            lse = s.logsumexp(-1)
        if not quick:
            ours_o = flash_attn_func(*[t.detach().requires_grad_() for t in (q, k, v)], causal=causal)
            row["ours"] = f"{flops / bench(lambda: ours_o.backward(do, retain_graph=True)) / 1e9:.0f}"
            def cudnn_out():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(*(t.detach().requires_grad_().transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
            c_o = cudnn_out()
            row["cudnn"] = f"{flops / bench(lambda: c_o.backward(do, retain_graph=True)) / 1e9:.0f}"
        for ws in (True,):
            for dkdv_cfg in dkdv_cfgs:
                for dq_cfg in dq_cfgs[:1] if dkdv_cfg != dkdv_cfgs[0] else dq_cfgs:
                    name = f"kv{'x'.join(map(str, dkdv_cfg))}_q{'x'.join(map(str, dq_cfg))}{'ws' if ws else ''}"
                    try:
                        grads = ws_backward(q, k, v, o, do, lse, causal, dkdv_cfg, dq_cfg, ws)
                        errs = [(g.float() - r).abs().max().item() for g, r in zip(grads, refs)]
                        ok = all(e <= 2 * bs + 1e-6 for e, bs in zip(errs, bases))
                        ms = bench(lambda: ws_backward(q, k, v, o, do, lse, causal, dkdv_cfg, dq_cfg, ws))
                        row[name] = f"{flops / ms / 1e9:.0f}" + ("" if ok else "!ERR" + ",".join(f"{e / max(bs, 1e-9):.1f}" for e, bs in zip(errs, bases)))
                    except Exception as e:
                        row[name] = "fail:" + (str(e).strip().splitlines()[-1][:80] if str(e).strip() else repr(e)[:80])
                    print(json.dumps({"d": d, "n": n, "causal": causal, name: row[name]}), flush=True)
        table.append(row)
    names = list(dict.fromkeys(k2 for r in table for k2 in r))
    print("| " + " | ".join(names) + " |")
    for r in table:
        print("| " + " | ".join(str(r.get(k2, "")) for k2 in names) + " |")
    if os.environ.get("OUT"):
        json.dump(table, open(os.path.join(os.environ["OUT"], "ws_bwd.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
