import re, sys, collections
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _tile(q, k_desc, v_desc, start, m_i, l_i, acc, qk_scale, offs_m, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    k = k_desc.load([start, 0])
    s = tl.dot(q, k.T)
    if MASKED:
        offs_n = start + tl.arange(0, BLOCK_N)
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([start, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc

@triton.jit
def toy_fwd(Q, K, V, O, N, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            WS: tl.constexpr, CAUSAL: tl.constexpr, TWO_LOOPS: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    q_desc = tl.make_tensor_descriptor(Q + bh * N * HEAD_DIM, [N, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + bh * N * HEAD_DIM, [N, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + bh * N * HEAD_DIM, [N, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O + bh * N * HEAD_DIM, [N, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    q = q_desc.load([pid * BLOCK_M, 0])
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        hi = (pid + 1) * BLOCK_M
        if TWO_LOOPS:
            for start in tl.range(0, pid * BLOCK_M, BLOCK_N, warp_specialize=WS):
                m_i, l_i, acc = _tile(q, k_desc, v_desc, start, m_i, l_i, acc, qk_scale, offs_m, False, BLOCK_N)
            for start in tl.range(pid * BLOCK_M, hi, BLOCK_N, warp_specialize=WS):
                m_i, l_i, acc = _tile(q, k_desc, v_desc, start, m_i, l_i, acc, qk_scale, offs_m, True, BLOCK_N)
        else:
            for start in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
                m_i, l_i, acc = _tile(q, k_desc, v_desc, start, m_i, l_i, acc, qk_scale, offs_m, True, BLOCK_N)
    else:
        for start in tl.range(0, N, BLOCK_N, warp_specialize=WS):
            m_i, l_i, acc = _tile(q, k_desc, v_desc, start, m_i, l_i, acc, qk_scale, offs_m, False, BLOCK_N)
    acc = acc / l_i[:, None]
    o_desc.store([pid * BLOCK_M, 0], acc.to(O.dtype.element_ty))

def build(warps, stages, **cx):
    names = toy_fwd.arg_names
    sig = {n: ("constexpr" if n in cx else "*bf16" if n in "QKVO" else "fp32" if n == "qk_scale" else "i32") for n in names}
    consts = {(names.index(k),): v for k, v in cx.items()}
    src = ASTSource(fn=toy_fwd, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})

for causal, two in ((False, False), (True, False), (True, True)):
    for bn in (64, 128):
        for stages in (2, 3):
            cx = dict(HEAD_DIM=int(sys.argv[1]) if len(sys.argv) > 1 else 128, BLOCK_M=128, BLOCK_N=bn, WS=True, CAUSAL=causal, TWO_LOOPS=two)
            try:
                c = build(4, stages, **cx)
                ptx = c.asm["ptx"]
                print(triton.__version__, f"causal={causal} two={two} bn={bn} st={stages}", "waits", dict(collections.Counter(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx))),
                      "setmaxnreg", sorted(set(re.findall(r"setmaxnreg.(\w+).sync.aligned.u32 (\d+)", ptx))), "smem", c.metadata.shared, "warps", c.metadata.num_warps, flush=True)
            except Exception as e:
                print(f"causal={causal} two={two} bn={bn} st={stages} ERR", (str(e).strip().splitlines() or [repr(e)])[-1][:200], flush=True)
