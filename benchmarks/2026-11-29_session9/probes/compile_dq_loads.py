import sys, re, collections
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def dqv(Q, K, V, DO, DQ, LSE2, DELTA, stride_b, stride_s, stride_h, seqlen, qk_scale, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VAR: tl.constexpr):
    pid = tl.program_id(0)
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
    if VAR == 1:
        do = q
    else:
        do = do_desc.load([m0, 0])
    if VAR == 2:
        lse = rows.to(tl.float32)
        delta = lse
    elif VAR == 4:
        lse_desc = tl.make_tensor_descriptor(LSE2 + row_off, [seqlen], [1], [BLOCK_M])
        delta_desc = tl.make_tensor_descriptor(DELTA + row_off, [seqlen], [1], [BLOCK_M])
        lse = lse_desc.load([m0])
        delta = delta_desc.load([m0])
    elif VAR == 5:
        lse = rows.to(tl.float32)
        delta = lse
    else:
        lse = tl.load(LSE2 + row_off + rows)
        delta = tl.load(DELTA + row_off + rows)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in tl.range(0, seqlen, BLOCK_N, warp_specialize=True):
        k = k_desc.load([n0, 0])
        if VAR == 3:
            v = k
        else:
            v = v_desc.load([n0, 0])
        if VAR == 5:
            lse = tl.load(LSE2 + row_off + rows)
            delta = tl.load(DELTA + row_off + rows)
        s = tl.dot(q, k.T)
        p = tl.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, v.T)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    dq_desc.store([m0, 0], (dq * sm_scale).to(DQ.dtype.element_ty))

def comp(fn, cx, warps, stages):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in cx else "*fp32" if n in ("LSE2", "DELTA") else "*bf16" if n.isupper() else "fp32" if "scale" in n else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    return dict(warps=c.metadata.num_warps, smem=c.metadata.shared, waits=dict(collections.Counter(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx))))
for var in (4, 5):
    try: print("var", var, comp(dqv, dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, VAR=var), 4, 2), flush=True)
    except Exception as e: print("var", var, "ERR", flush=True)
