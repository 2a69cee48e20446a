"""flash-attn's pass rule, shared by the kernel tests.

ours passes when max |ours - ref| <= 2 * max |lowp - ref| + floor, where ref is the math in fp64,
lowp is the same math done by PyTorch in the input precision, and floor is the rounding error of
storing ref in the input dtype (a result can be no closer than that) plus 1e-4 for results that are
exactly 0: with a single key dS cancels to 0 in fp64 and in PyTorch's softmax backward, while the
kernel's dP (tensor-core sum) and delta (rowsum of dO * O) round differently in fp32 and leave
~1e-5..3e-5 of noise after summing hundreds of rows (measured). 1e-4 is a tenth of an fp16 ulp at 1.0.
"""

import torch

from flashformer.kernels import attention_materialized


def assert_within_2x(name, ours, ref, lowp):
    assert not torch.isnan(ours).any(), f"{name}: NaN in result (an element left unwritten?)"
    ref = ref.double()
    err = (ours.double() - ref).abs().max().item()
    lowp_err = (lowp.double() - ref).abs().max().item()
    floor = (ref.to(ours.dtype).double() - ref).abs().max().item() + 1e-4
    assert err <= 2 * lowp_err + floor, f"{name}: max err {err:.3e} > 2 x {lowp_err:.3e} + {floor:.1e}"


def attention_grads(fn, q, k, v, grad_out, **kwargs):
    """Run ``fn`` on leaf copies of q, k, v; return (out, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return (out, *grads)


def assert_matches_reference(fn, q, k, v, grad_out, **opts):
    """out, dq, dk, dv of ``fn`` against fp64 math, by the 2x rule against PyTorch in q's precision."""
    ours = attention_grads(fn, q, k, v, grad_out, **opts)
    ref = attention_grads(attention_materialized, q.double(), k.double(), v.double(), grad_out, **opts)
    lowp = attention_grads(attention_materialized, q, k, v, grad_out, upcast=False, **opts)
    for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_within_2x(name, a, r, l)


# Run in a fresh interpreter: on CPU, torch 2.13's custom-op dispatch intermittently raises
# ValueError('vector::reserve') in a process that has already run hundreds of other tests (reproducible
# with MALLOC_PERTURB_; never in a fresh process, never with torch 2.11 on CUDA).
_COMPILE_CHECK = """
import sys
import torch
from torch._dynamo.backends.common import aot_autograd
from flashformer.kernels import flash_attn_func

device = sys.argv[1]
graphs = {}

def keep(name):
    def compiler(graph_module, example_inputs):
        graphs[name] = graph_module
        return graph_module
    return compiler

q, k, v = (torch.randn(1, 40, 2, 32, device=device, dtype=torch.float16, requires_grad=True) for _ in range(3))
options = eval(sys.argv[2])

def attend(q, k, v):
    return flash_attn_func(q * 1.0, k, v, causal=True, **options).float().square().sum()

backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
torch.manual_seed(3)
loss = torch.compile(attend, fullgraph=True, backend=backend)(q, k, v)
loss.backward()
# Each pass must reach the kernels as the opaque op: traced through, they would see fake tensors.
for name, op in (("forward", "flashformer.flash_attn_fwd.default"), ("backward", "flashformer.flash_attn_bwd.default")):
    targets = {str(node.target) for node in graphs[name].graph.nodes}
    assert op in targets, (name, sorted(targets))
compiled_grads = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
torch.manual_seed(3)  # the same dropout seed, drawn inside the graph and eagerly from one generator
eager = attend(q, k, v)
eager.backward()
assert torch.equal(loss, eager), (loss, eager)
assert all(torch.equal(a, t.grad) for a, t in zip(compiled_grads, (q, k, v)))
"""


def assert_compiles_full_graph(device, options="{}"):
    """flash_attn_func(causal=True, **options) under torch.compile(fullgraph=True) in a fresh process: both
    passes are opaque torch.library nodes, and loss and gradients equal the eager call's bit for bit.

    Args:
        options: a Python expression (``device`` and ``torch`` in scope) for the extra keyword arguments.
    """
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _COMPILE_CHECK, device, options], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
