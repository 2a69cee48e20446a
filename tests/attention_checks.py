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
