"""The Triton cross-entropy rows (kernels/cross_entropy.py) against fp64 math on the same logits, by
flash-attn's rule: at most 2x the error of the torch path, which does the same math with fp32 copies.
On CPU the kernels run in Triton's interpreter (the triton_path fixture); on the GPU natively."""

import pytest
import torch
import torch.nn.functional as F

from flashformer.kernels import force_kernel_impl
from flashformer.kernels.cross_entropy import cross_entropy_rows, cross_entropy_rows_grad_
from flashformer.losses import chunked_cross_entropy

IGNORE = -100


def reference(logits, targets, bias, softcap, token_scale):
    """fp64 (lse, loss, grad) from the same logits."""
    x = logits.double().requires_grad_()
    capped = x + bias.double() if bias is not None else x
    if softcap > 0.0:
        capped = softcap * torch.tanh(capped / softcap)
    lse = torch.logsumexp(capped, dim=-1)
    losses = F.cross_entropy(capped, targets, ignore_index=IGNORE, reduction="none")
    (grad,) = torch.autograd.grad((losses * token_scale.double()).sum(), x)
    return lse.detach(), losses.detach(), grad


def both_paths(fn):
    with force_kernel_impl("torch"):
        torch_result = fn()
    return fn(), torch_result


@pytest.mark.parametrize("rows,vocab", [(1, 1), (7, 63), (5, 64), (6, 1000), (4, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,softcap", [(False, 0.0), (True, 0.0), (True, 3.0)])
def test_rows_match_fp64(rows, vocab, dtype, bias, softcap, device, triton_path):
    logits = (torch.randn(rows, vocab, device=device) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=device)
    targets[1::3] = IGNORE
    bias_t = torch.randn(vocab, device=device).to(dtype) if bias else None
    token_scale = torch.rand(rows, device=device) * (targets != IGNORE)
    safe_targets = torch.where(targets != IGNORE, targets, 0)
    ref_lse, ref_loss, ref_grad = reference(logits, targets, bias_t, softcap, token_scale)

    (lse, loss), (torch_lse, torch_loss) = both_paths(
        lambda: cross_entropy_rows(logits, targets, IGNORE, bias_t, softcap))
    grad, torch_grad = both_paths(lambda: cross_entropy_rows_grad_(
        logits.clone(), safe_targets, ref_lse.float(), token_scale, bias_t, softcap))
    assert lse.dtype == loss.dtype == torch.float32 and grad.dtype == dtype
    for name, ours, torch_path, ref in (("lse", lse, torch_lse, ref_lse), ("loss", loss, torch_loss, ref_loss),
                                        ("grad", grad, torch_grad, ref_grad)):
        assert torch.isfinite(ours).all(), name
        ours_err = (ours.double() - ref).abs().max().item()
        torch_err = (torch_path.double() - ref).abs().max().item()
        assert ours_err <= 2 * torch_err + 1e-6, f"{name}: ours {ours_err:.3g}, torch path {torch_err:.3g}"
    assert (loss[1::3] == 0).all() and (grad[1::3] == 0).all()  # ignored rows


def test_chunked_loss_through_the_kernels(device, triton_path):
    """The whole chunked LM-head loss in bf16 (as under autocast) on the kernels' path, against fp64."""
    hidden = torch.randn(40, 32, device=device).bfloat16().requires_grad_()
    weight = (torch.randn(300, 32, device=device) / 32**0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (40,), device=device)
    targets[:9] = IGNORE
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=16)
    grads = torch.autograd.grad(loss, (hidden, weight))
    h64, w64 = hidden.double().detach().requires_grad_(), weight.double().detach().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), targets, ignore_index=IGNORE)
    ref_grads = torch.autograd.grad(ref, (h64, w64))
    torch.testing.assert_close(loss.double(), ref.detach(), atol=2e-2, rtol=0)
    for ours, expected in zip(grads, ref_grads):
        torch.testing.assert_close(ours.double(), expected, atol=2e-2, rtol=2e-2)
