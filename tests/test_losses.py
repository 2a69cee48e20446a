"""Chunked LM head + cross-entropy: exact against F.cross_entropy, and bounded in memory."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flashformer import losses
from flashformer.losses import chunked_cross_entropy, lm_head_loss


def make_inputs(tokens, vocab, d_model, dtype=torch.float32, bias=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, d_model, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=generator) / d_model**0.5).to(dtype).requires_grad_()
    bias_t = torch.randn(vocab, generator=generator).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return hidden, weight, bias_t, targets


def reference_loss(hidden, weight, bias, targets, upcast=True, softcap=0.0, **kwargs):
    """The materialized formula; upcast=True computes in fp64 from the same inputs."""
    if upcast:
        hidden, weight = hidden.double(), weight.double()
        bias = bias.double() if bias is not None else None
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    if softcap > 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, **kwargs)


def loss_and_grads(loss_fn, inputs, grad_seed=1):
    hidden, weight, bias, targets = inputs
    loss = loss_fn(hidden, weight, bias, targets)
    grad_out = torch.randn(loss.shape, generator=torch.Generator().manual_seed(grad_seed)).to(loss.dtype)
    params = [t for t in (hidden, weight, bias) if t is not None]
    return [loss.detach(), *torch.autograd.grad(loss, params, grad_out)]


def assert_close_all(ours, ref, rtol, atol=0.0):
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), ours, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("tokens,vocab,d_model,chunk_size", [(37, 50, 16, 8), (64, 257, 32, 64),
                                                             (100, 31, 8, 1), (20, 40, 16, 1000)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_cross_entropy_fp32(tokens, vocab, d_model, chunk_size, reduction, bias):
    inputs = make_inputs(tokens, vocab, d_model, bias=bias)
    inputs[3][::3] = -100  # every third token ignored
    ours = loss_and_grads(lambda h, w, b, t: chunked_cross_entropy(
        h, w, t, bias=b, chunk_size=chunk_size, reduction=reduction), inputs)
    ref = loss_and_grads(lambda h, w, b, t: reference_loss(h, w, b, t, reduction=reduction), inputs)
    assert ours[0].dtype == torch.float32
    assert_close_all(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_ignore_index_and_softcap(softcap):
    inputs = make_inputs(48, 64, 16, bias=True)
    targets = inputs[3]
    targets[5:40] = 7  # a custom ignore_index that is also a valid class id elsewhere
    targets[0] = 3
    ours = loss_and_grads(lambda h, w, b, t: chunked_cross_entropy(
        h, w, t, bias=b, ignore_index=7, chunk_size=8, softcap=softcap), inputs)
    ref = loss_and_grads(lambda h, w, b, t: reference_loss(h, w, b, t, ignore_index=7, softcap=softcap),
                         inputs)
    assert_close_all(ours, ref, rtol=1e-5, atol=1e-6)


def test_all_ignored_chunks_are_skipped(monkeypatch):
    inputs = make_inputs(64, 40, 16)
    targets = inputs[3]
    targets[:48] = -100  # chunks 0-2 of 16 tokens hold no target, chunk 3 holds 16
    computed_rows = []

    def counting(rows_fn):
        def counted(logits, *args):
            computed_rows.append(logits.shape[0])
            return rows_fn(logits, *args)
        return counted

    monkeypatch.setattr(losses, "cross_entropy_rows", counting(losses.cross_entropy_rows))
    monkeypatch.setattr(losses, "cross_entropy_rows_grad_", counting(losses.cross_entropy_rows_grad_))
    ours = loss_and_grads(lambda h, w, b, t: chunked_cross_entropy(h, w, t, chunk_size=16), inputs)
    assert computed_rows == [16, 16]  # one chunk in forward, the same one in backward
    ref = loss_and_grads(lambda h, w, b, t: reference_loss(h, w, b, t), inputs)
    assert_close_all(ours, ref, rtol=1e-5, atol=1e-6)
    assert ours[1][:48].abs().max() == 0


def test_every_token_ignored_gives_nan_like_pytorch():
    hidden, weight, _, targets = make_inputs(16, 20, 8)
    targets.fill_(-100)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=4)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(hidden @ weight.t(), targets))
    loss.backward()
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_within_twice_pytorch_bf16_error(bias):
    """As flash-attn tests: error vs an fp64 reference at most twice that of PyTorch in bf16."""
    inputs = make_inputs(96, 300, 64, dtype=torch.bfloat16, bias=bias)
    inputs[3][::5] = -100
    ours = loss_and_grads(lambda h, w, b, t: chunked_cross_entropy(h, w, t, bias=b, chunk_size=32), inputs)
    ref = loss_and_grads(lambda h, w, b, t: reference_loss(h, w, b, t), inputs)
    lowp = loss_and_grads(lambda h, w, b, t: reference_loss(h, w, b, t, upcast=False), inputs)
    for name, a, r, p in zip(("loss", "hidden", "weight", "bias"), ours, ref, lowp):
        assert a.dtype == (torch.float32 if name == "loss" else torch.bfloat16)
        error = (a.double() - r.double()).abs().max().item()
        lowp_error = (p.double() - r.double()).abs().max().item()
        assert error <= 2 * lowp_error + 1e-6, f"{name}: {error} > 2 x {lowp_error}"


class LargestTensor(TorchDispatchMode):
    """Records the numel of the largest tensor any aten op returns, forward and backward."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(out, torch.Tensor):
                self.numel = max(self.numel, out.numel())
        return result


def largest_tensor_of_step(loss_fn, inputs):
    with LargestTensor() as tracker:
        loss_and_grads(loss_fn, inputs)
    return tracker.numel


def test_no_tensor_larger_than_one_chunk_of_logits():
    tokens, vocab, d_model, chunk_size = 512, 1000, 16, 64
    inputs = make_inputs(tokens, vocab, d_model, bias=True)
    bound = chunk_size * vocab  # everything else (hidden, weight and their grads) is smaller
    assert max(tokens, vocab) * d_model < bound
    materialized = largest_tensor_of_step(lambda h, w, b, t: reference_loss(h, w, b, t, upcast=False), inputs)
    assert materialized >= tokens * vocab  # the tracker sees the full logits when they exist
    chunked = largest_tensor_of_step(lambda h, w, b, t: chunked_cross_entropy(
        h, w, t, bias=b, chunk_size=chunk_size), inputs)
    assert chunked <= bound


def test_lm_head_loss_materializes_small_and_chunks_large(monkeypatch):
    batch, seqlen, vocab, d_model = 2, 24, 50, 4
    hidden, weight, _, targets = make_inputs(batch * seqlen, vocab, d_model)
    hidden_3d = hidden.detach().view(batch, seqlen, d_model).requires_grad_()
    targets = targets.view(batch, seqlen)
    ref = loss_and_grads(lambda h, w, b, t: reference_loss(h.reshape(-1, d_model), w, None, t.reshape(-1)),
                         (hidden_3d, weight, None, targets))
    small = LargestTensor()
    with small:
        materialized = loss_and_grads(lambda h, w, b, t: lm_head_loss(h, w, t), (hidden_3d, weight, None, targets))
    monkeypatch.setattr(losses, "MATERIALIZED_LOGITS_MAX_ELEMENTS", 100)
    monkeypatch.setattr(losses, "CHUNK_LOGITS_ELEMENTS", 8 * vocab)
    large = LargestTensor()
    with large:
        chunked = loss_and_grads(lambda h, w, b, t: lm_head_loss(h, w, t), (hidden_3d, weight, None, targets))
    assert small.numel == batch * seqlen * vocab and large.numel == 8 * vocab
    assert_close_all(materialized, ref, rtol=1e-5, atol=1e-6)
    assert_close_all(chunked, ref, rtol=1e-5, atol=1e-6)


def test_autocast_with_fp32_weights():
    hidden, weight, _, targets = make_inputs(32, 40, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_size=8)
    loss.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    ref = reference_loss(hidden.detach(), weight.detach(), None, targets)
    assert abs(loss.item() - ref.item()) < 0.05


@pytest.mark.parametrize("kwargs,match", [({"reduction": "avg"}, "reduction"), ({"chunk_size": 0}, "chunk_size"),
                                          ({"softcap": -1.0}, "softcap"), ({"softcap": float("nan")}, "softcap"),
                                          ({"bias": torch.zeros(3)}, "bias")])
def test_rejects_bad_arguments(kwargs, match):
    hidden, weight, _, targets = make_inputs(8, 10, 8)
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(hidden, weight, targets, **kwargs)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets.int())
