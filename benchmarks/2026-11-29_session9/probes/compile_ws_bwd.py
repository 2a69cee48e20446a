import sys, re, collections
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from ws_bwd import _ws_dkdv, _ws_dq, _ws_fwd_diag
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
def comp(fn, cx, warps, stages):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in cx else "*fp32" if n in ("LSE2", "DELTA") else "*bf16" if n.isupper() else "fp32" if "scale" in n else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    return dict(warps=c.metadata.num_warps, smem=c.metadata.shared, waits=dict(collections.Counter(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx))))
for causal in (False, True):
    for (bm, bn, w, st) in [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2), (128, 128, 4, 2)]:
        try: print("dkdv", causal, (bm, bn, w, st), comp(_ws_dkdv, dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, WS=True, CAUSAL=causal), w, st), flush=True)
        except Exception as e: print("dkdv", causal, (bm, bn, w, st), "ERR", flush=True)
    for (bm, bn, w, st) in [(128, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 3)]:
        try: print("dq", causal, (bm, bn, w, st), comp(_ws_dq, dict(HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, WS=True, CAUSAL=causal), w, st), flush=True)
        except Exception as e: print("dq", causal, (bm, bn, w, st), "ERR", [l for l in str(e).splitlines() if "error" in l][:3], flush=True)
for mode in (0, 1):
    print("diag", mode, comp(_ws_fwd_diag, dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, WS=True, MODE=mode), 4, 2))
