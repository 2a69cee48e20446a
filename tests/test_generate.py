"""Sampling, the KV-cached generation loop (function and model.generate), the generate CLI, the tokenizers
it uses, and the README's Python example."""

import os
import re
import warnings

import pytest
import torch

import flashformer
from flashformer.generate import generate, main
from flashformer.model import ModelConfig, Transformer
from flashformer.sampling import _decode_step, _DeviceLengthCache, sample_next_token
from flashformer.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from flashformer.weights import CheckpointError

VOCAB = 257


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96,
                                    max_seq_len=64))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


PROMPT = torch.tensor([[72, 101, 108, 108, 111], [87, 111, 114, 108, 100]])


def test_greedy_is_deterministic_and_equals_full_recompute(model):
    out = generate(model, PROMPT, 10, temperature=0)
    assert out.shape == (2, 15) and torch.equal(out[:, :5], PROMPT)
    assert torch.equal(out, generate(model, PROMPT, 10, temperature=0))
    sequence = PROMPT
    with torch.no_grad():
        for _ in range(10):
            sequence = torch.cat([sequence, model(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, sequence)
    assert torch.equal(generate(model, PROMPT, 10, top_k=1, seed=3), out)


def test_seed_reproducibility(model):
    first = generate(model, PROMPT, 12, temperature=1.0, seed=123)
    assert torch.equal(first, generate(model, PROMPT, 12, temperature=1.0, seed=123))
    assert not torch.equal(first, generate(model, PROMPT, 12, temperature=1.0, seed=124))


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])).expand(4000, 5)
    generator = torch.Generator().manual_seed(0)
    top_k = sample_next_token(logits, top_k=2, generator=generator)
    assert set(top_k.tolist()) == {0, 1}
    top_p = sample_next_token(logits, top_p=0.8, generator=generator)  # 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15
    assert set(top_p.tolist()) == {0, 1, 2}
    assert abs((top_p == 0).float().mean().item() - 0.4 / 0.85) < 0.03
    assert set(sample_next_token(logits, top_p=0.1, generator=generator).tolist()) == {0}
    assert set(sample_next_token(logits, temperature=0).tolist()) == {0}


def test_stop_tokens_end_each_row(model):
    greedy = generate(model, PROMPT, 10, temperature=0)
    stop_row0 = int(greedy[0, 7])
    first_stop = 5 + greedy[0, 5:].tolist().index(stop_row0)
    out = generate(model, PROMPT[:1], 10, temperature=0, stop_tokens=(stop_row0,))
    assert torch.equal(out, greedy[:1, :first_stop + 1])

    stop_row1 = int(greedy[1, 6])
    streamed = []
    out = generate(model, PROMPT, 10, temperature=0, stop_tokens=(stop_row0, stop_row1),
                   stream=lambda tokens: streamed.append(tokens.clone()))
    assert torch.equal(torch.stack(streamed, dim=1), out[:, 5:])
    for row in range(2):
        hits = [i for i, t in enumerate(out[row, 5:].tolist()) if t in (stop_row0, stop_row1)]
        assert torch.equal(out[row, :5 + hits[0] + 1], greedy[row, :5 + hits[0] + 1])
        assert set(out[row, 5 + hits[0]:].tolist()) == {int(out[row, 5 + hits[0]])}  # padded with its stop token


def test_model_generate_is_the_loop_with_transformers_names(model):
    greedy = generate(model, PROMPT, 10, temperature=0)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=10, temperature=0), greedy)
    sampled = generate(model, PROMPT, 10, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(model.generate(PROMPT, 10, temperature=0.9, top_k=20, top_p=0.9, seed=7), sampled)
    stop = int(greedy[0, 7])
    first_stop = 5 + greedy[0, 5:].tolist().index(stop)
    for eos_token_id in (stop, [stop], (stop, 1000)):
        out = model.generate(PROMPT[:1], max_new_tokens=10, temperature=0, eos_token_id=eos_token_id)
        assert torch.equal(out, greedy[:1, :first_stop + 1]), eos_token_id
    assert torch.equal(model.generate(PROMPT[0], 3, temperature=0), greedy[:1, :8])  # a 1-d prompt is one row
    for bad in ("2", [1.5], [True], -1):
        with pytest.raises(ValueError, match="eos_token_id"):
            model.generate(PROMPT, 3, eos_token_id=bad)
    with pytest.raises(ValueError, match="stop_tokens"):
        generate(model, PROMPT, 3, stop_tokens=["a"])


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="temperature"):
        generate(model, PROMPT, 3, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, PROMPT, 3, top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, PROMPT, 3, top_k=0)
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def _flash_model(device, rope=True):
    torch.manual_seed(1)
    config = ModelConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96, max_seq_len=64,
                         **({} if rope else {"family": "custom", "pos": "learned"}))
    model = Transformer(config, attn_backend="flash").to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "learned"])
def test_device_length_cache_decodes_like_the_host_length_cache(rope, device, triton_path):
    """The CUDA-graph step's cache keeps its length on the device and appends without a host sync;
    stepped eagerly it must give the logits of the ordinary cache, token by token."""
    model = _flash_model(device, rope)
    prompt = PROMPT.to(device)
    host, graph_side = model.new_kv_cache(2, 16), model.new_kv_cache(2, 16)
    with torch.no_grad():
        model(prompt, kv_cache=host)
        model(prompt, kv_cache=graph_side)
        cache = _DeviceLengthCache(graph_side)
        for token in ([3, 7], [100, 256], [0, 42]):
            tokens = torch.tensor(token, device=device)[:, None]
            expected = model(tokens, kv_cache=host)[:, -1]
            torch.testing.assert_close(_decode_step(model, tokens, cache), expected, atol=1e-5, rtol=1e-5)
    assert cache.length.tolist() == [host.length, host.length]
    assert all(torch.equal(a, b) for a, b in zip(host.keys, graph_side.keys))


def test_cuda_graph_needs_cuda_and_the_flash_backend(model):
    with pytest.raises(ValueError, match="CUDA device"):
        generate(model, PROMPT, 3, cuda_graph=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_generation_equals_eager():
    model = _flash_model("cuda")
    prompt = PROMPT.to("cuda")
    eager = generate(model, prompt, 20, temperature=0)
    assert torch.equal(generate(model, prompt, 20, temperature=0, cuda_graph=True), eager)
    sampled = generate(model, prompt, 20, temperature=1.0, top_k=20, seed=5)
    assert torch.equal(generate(model, prompt, 20, temperature=1.0, top_k=20, seed=5, cuda_graph=True), sampled)
    model.attn_backend = "sdpa"
    with pytest.raises(ValueError, match="attn_backend"):
        generate(model, prompt, 3, cuda_graph=True)


def test_cli_streams_text(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "ckpt")
    expected = generate(model, torch.tensor([list("Hé".encode())]), 6, temperature=0, stop_tokens=(256,))
    expected_text = ByteTokenizer().decode(t for t in expected[0].tolist() if t != 256) + "\n"
    for backend in ("auto", "sdpa", "naive"):  # each decodes through its own math over the cache
        assert main([str(tmp_path / "ckpt"), "--prompt", "Hé", "--max-new-tokens", "6", "--temperature", "0",
                     "--attn-backend", backend]) == 0
        assert capsys.readouterr().out == expected_text, backend


def test_byte_tokenizer():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("naïve ✓")
    assert all(0 <= i < 256 for i in ids) and tokenizer.decode(ids) == "naïve ✓"
    assert tokenizer.vocab_size == 257 and tokenizer.eos_id == 256
    assert tokenizer.decode([104, 105, 256]) == "hi<|endoftext|>"
    assert tokenizer.decode(ids[:-1]) == "naïve \ufffd"  # a cut multi-byte character does not raise
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([300])


def test_bpe_training_and_loading(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    tokenizer = train_bpe([text], 300, tmp_path / "tokenizer.json")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer) and tokenizer.vocab_size <= 300
    ids = tokenizer.encode("the lazy fox")
    assert len(ids) < len("the lazy fox") and tokenizer.decode(ids) == "the lazy fox"
    assert tokenizer.eos_id == 0
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    (tmp_path / "byte_level_checkpoint").mkdir()
    assert isinstance(load_tokenizer(tmp_path / "byte_level_checkpoint"), ByteTokenizer)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe([text], 100, tmp_path / "small.json")


def test_load_tokenizer_pairs_with_from_pretrained_on_a_run_directory(model, tmp_path):
    run = tmp_path / "run"
    model.save_pretrained(run / "ckpt-3")
    model.save_pretrained(run / "ckpt-12")
    assert isinstance(flashformer.load_tokenizer(run), ByteTokenizer)  # no tokenizer.json: bytes
    text = tmp_path / "corpus.txt"
    text.write_text("def main():\n    return 0\n" * 40)
    train_bpe([text], 280, run / "ckpt-12" / "tokenizer.json")
    tokenizer = flashformer.load_tokenizer(run)  # the latest checkpoint's, as from_pretrained(run) loads it
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.decode(tokenizer.encode("def main")) == "def main"
    with pytest.raises(CheckpointError, match="not found"):
        flashformer.load_tokenizer(tmp_path / "missing")


def _readme_python_example():
    """The first ```python block of the README's "Models, checkpoints, generation" section."""
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("## Models, checkpoints, generation"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    """The example, as written, on a run directory shaped like configs/tiny.yaml's (smaller, untrained)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny_shape = ModelConfig(family="llama", vocab_size=257, d_model=32, n_layer=2, n_head=2, d_ff=64, max_seq_len=256,
                             tie_embeddings=False)
    Transformer(tiny_shape).save_pretrained(tmp_path / "runs" / "tiny" / "ckpt-300")
    latest = Transformer(tiny_shape)
    latest.save_pretrained(tmp_path / "runs" / "tiny" / "ckpt-600")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. generating past max_seq_len
        exec(compile(_readme_python_example(), "README.md", "exec"), namespace)
    assert capsys.readouterr().out.startswith("def ")
    model, ids, out = namespace["model"], namespace["ids"], namespace["out"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), latest.state_dict().values()))
    assert ids.tolist() == [list(b"def ")] and torch.equal(out[:, :4], ids) and 4 < out.shape[1] <= 104
    assert namespace["logits"].shape == (1, 4, 257) and namespace["loss"].shape == ()
    expected_loss = torch.nn.functional.cross_entropy(namespace["logits"][0, :-1], ids[0, 1:])
    torch.testing.assert_close(namespace["loss"], expected_loss)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(hf(ids).logits, namespace["logits"], atol=1e-4, rtol=1e-4)
