"""Experiment: Hopper warp specialisation (tl.range(warp_specialize=True)) on a one-loop forward."""
import itertools, json, os, sys, time
import torch, triton, triton.language as tl
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

@triton.jit
def _ws_fwd(Q, K, V, O, LSE, stride_b, stride_s, stride_h, seqlen, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
            CAUSAL: tl.constexpr, FOLD: tl.constexpr):
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
    hi = tl.minimum(m0 + BLOCK_M, seqlen) if CAUSAL else seqlen
    for n0 in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([n0, 0])
        s = tl.dot(q, k.T)
        if FOLD:
            if CAUSAL:
                s = tl.where(rows[:, None] >= (n0 + tl.arange(0, BLOCK_N))[None, :], s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - new_max[:, None])
        else:
            s = s * qk_scale
            if CAUSAL:
                s = tl.where(rows[:, None] >= (n0 + tl.arange(0, BLOCK_N))[None, :], s, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(s, 1))
            p = tl.exp2(s - new_max[:, None])
        alpha = tl.exp2(row_max - new_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = v_desc.load([n0, 0])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    acc = acc / row_sum[:, None]
    o_desc.store([m0, 0], acc.to(O.dtype.element_ty))
    tl.store(LSE + (batch * tl.num_programs(1) + head) * seqlen + rows, (row_max + tl.log2(row_sum)) * 0.6931471805599453, mask=rows < seqlen)


def ws_forward(q, k, v, causal, block_m, block_n, warps, stages, ws, fold=True):
    b, n, h, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    _ws_fwd[(triton.cdiv(n, block_m), h, b)](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), n,
                                           d ** -0.5 * 1.4426950408889634, HEAD_DIM=d, BLOCK_M=block_m,
                                           BLOCK_N=block_n, WS=ws, CAUSAL=causal, FOLD=fold,
                                           num_warps=warps, num_stages=stages)
    return o


def main():
    from flashformer.kernels import flash_attn_func
    from flashformer.kernels.launch import ensure_allocator
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    else:
        ensure_allocator(dev)
    quick = dev.type == "cpu"
    cells = [(64, 128, 2)] if quick else [(d, s, 16384 // s) for d in (128, 64) for s in (1024, 4096, 16384)]
    variants = [(128, 64, 4, 2, True), (128, 64, 4, 3, True), (128, 128, 4, 2, True), (128, 64, 8, 2, False), (128, 128, 8, 2, False)]
    if quick:
        variants = [(32, 16, 4, 2, True)]
    rows = []
    for (d, n, b), causal in itertools.product(cells, (True, False)):
        h = 2048 // d if not quick else 2
        q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=torch.bfloat16 if not quick else torch.float16) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        base_err = (F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2).float() - ref).abs().max().item()
        row = {"d": d, "n": n, "causal": causal}
        impls = {}
        if not quick:
            impls["ours"] = lambda: flash_attn_func(q, k, v, causal=causal)
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
            impls["cudnn"] = cudnn
        for bm, bn, w, st, ws in variants:
            for fold in ((True, False) if not quick else (True,)):
                impls[f"{bm}x{bn}w{w}s{st}{'ws' if ws else ''}{'' if fold else 'nofold'}"] = (lambda bm=bm, bn=bn, w=w, st=st, ws=ws, fold=fold: ws_forward(q, k, v, causal, bm, bn, w, st, ws, fold))
        for name, fn in impls.items():
            try:
                out = fn()
                err = (out.float() - ref).abs().max().item()
                ok = err <= 2 * base_err + 1e-6
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") if not quick else float("nan")
                row[name] = f"{flops / ms / 1e9:.0f}{'' if ok else '!ERR%.3g' % err}"
            except Exception as e:
                row[name] = "fail:" + str(e).strip().splitlines()[-1][:80] if str(e).strip() else repr(e)[:80]
            print(json.dumps({k2: row[k2] for k2 in ("d", "n", "causal", name)}), flush=True)
        rows.append(row)
    names = list(rows[0].keys())
    print("| " + " | ".join(names) + " |")
    for r in rows:
        print("| " + " | ".join(str(r.get(k2, "")) for k2 in names) + " |")
    if os.environ.get("OUT"):
        json.dump(rows, open(os.path.join(os.environ["OUT"], "ws_fwd.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
