import sys, re, collections
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from ws_fwd2 import _fwd_v
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
def comp(fn, cx, warps, stages):
    names = fn.arg_names
    sig = {n: ("constexpr" if n in cx else "*fp32" if n == "LSE" else "*i32" if n == "ROW_IDS" else "*bf16" if n.isupper() else "fp32" if "scale" in n else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in cx.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    return dict(warps=c.metadata.num_warps, smem=c.metadata.shared, waits=dict(collections.Counter(re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx))))
for mode in (1, 2, 3, 4):
    for bn in (128, 64):
        try: print("mode", mode, bn, comp(_fwd_v, dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=bn, MODE=mode), 4, 2), flush=True)
        except Exception as e: print("mode", mode, bn, "ERR", flush=True)
