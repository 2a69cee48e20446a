"""Checkpoint format (weights.py, checkpoint.py): round trips, sharding, precise errors, atomic writes (fileio.py)."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashformer
from flashformer import fileio
from flashformer.fileio import atomic_directory, atomic_write_file
from flashformer.model import ModelConfig, Transformer
from flashformer.tokenizer import HFTokenizer, train_bpe
from flashformer.train.stops import Interrupted, interrupts_raise
from flashformer.weights import CheckpointError, save_pretrained

CONFIG = ModelConfig(family="llama", vocab_size=300, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96,
                     max_seq_len=64)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**CONFIG.__dict__, **overrides}))


def logits(model):
    with torch.no_grad():
        return model(torch.arange(20)[None] % model.config.vocab_size)


def test_round_trip_with_tokenizer(tmp_path):
    model = tiny_model(tie_embeddings=True)
    tokenizer = train_bpe(["hello world, hello tokenizer"] * 20, 270, tmp_path / "tok.json")
    model.save_pretrained(tmp_path / "ckpt", tokenizer=tokenizer)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = flashformer.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == model.config
    assert torch.equal(logits(loaded), logits(model))
    assert HFTokenizer(tmp_path / "ckpt" / "tokenizer.json").encode("hello") == tokenizer.encode("hello")


def test_round_trip_keeps_partial_rotary(tmp_path):
    model = tiny_model(family="phi3", partial_rotary_factor=0.75)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = flashformer.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == model.config and loaded.config.rotary_dim == 12
    assert torch.equal(logits(loaded), logits(model))


def test_dtype_device_and_backend_on_load(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path)
    loaded = flashformer.from_pretrained(tmp_path, dtype="bfloat16", device="cpu", attn_backend="naive")
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.attn_backend == "naive"
    assert (logits(loaded).float() - logits(model)).abs().max() < 0.1


@pytest.mark.parametrize("stored", ["auto", "flash-nondeterministic", "reference"])
def test_attn_backend_is_not_a_checkpoint_field(tmp_path, stored):
    """config.json holds no attn_backend; one written while it was a model field (any value it had) loads,
    and the loader's choice wins."""
    save_pretrained(tiny_model(), tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert "attn_backend" not in config_json["model"]
    config_json["model"]["attn_backend"] = stored
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    assert flashformer.from_pretrained(tmp_path, attn_backend="sdpa").attn_backend == "sdpa"


@pytest.mark.parametrize("format", ["flashformer", "hf"])
def test_sharding(tmp_path, format):
    model = tiny_model()
    save_pretrained(model, tmp_path / "ckpt", format=format, max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path / "ckpt"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert "model.safetensors" not in files
    loaded = flashformer.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(logits(loaded), logits(model))


def test_mismatched_tensors_are_listed_together(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["blocks.1.mlp.up_proj.weight"], tensors["final_norm.weight"]
    tensors["blocks.0.attn.q_proj.weight"] = torch.zeros(3, 3)
    tensors["blocks.0.extra.weight"] = torch.zeros(1)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        flashformer.from_pretrained(tmp_path)
    message = str(err.value)
    for expected in ("missing (2): blocks.1.mlp.up_proj.weight, final_norm.weight",
                     "unexpected (1): blocks.0.extra.weight",
                     "misshapen (1): blocks.0.attn.q_proj.weight (checkpoint (3, 3), model (64, 64))"):
        assert expected in message


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, got a list"):
        flashformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"format": "flashformer",')
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'config.json'} is not valid JSON"):
        flashformer.from_pretrained(tmp_path)


def test_a_stray_dtype_is_refused_unless_a_dtype_is_asked_for(tmp_path):
    save_pretrained(tiny_model(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["blocks.1.attn.o_proj.weight"] = tensors["blocks.1.attn.o_proj.weight"].half()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mixes floating dtypes: 1 in torch.float16 \(blocks.1.attn.o_proj"
                                              r".weight\), the rest in torch.float32"):
        flashformer.from_pretrained(tmp_path)
    model = flashformer.from_pretrained(tmp_path, dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_compiled_prefix_and_hf_buffers_are_ignored(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path / "ours")
    tensors = load_file(tmp_path / "ours" / "model.safetensors")
    save_file({f"_orig_mod.{k}": v for k, v in tensors.items()}, tmp_path / "ours" / "model.safetensors")
    assert torch.equal(logits(flashformer.from_pretrained(tmp_path / "ours")), logits(model))

    save_pretrained(model, tmp_path / "hf", format="hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(logits(flashformer.from_pretrained(tmp_path / "hf")), logits(model))


def test_truncated_and_corrupted_files_are_named(tmp_path):
    save_pretrained(tiny_model(), tmp_path / "a", max_shard_bytes=60_000)
    shard = tmp_path / "a" / sorted(os.listdir(tmp_path / "a"))[2]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted or truncated"):
        flashformer.from_pretrained(tmp_path / "a")

    save_pretrained(tiny_model(), tmp_path / "b")
    weights = tmp_path / "b" / "model.safetensors"
    weights.write_bytes(b"\xff" * 16 + weights.read_bytes()[16:])
    with pytest.raises(CheckpointError, match="model.safetensors is corrupted or truncated"):
        flashformer.from_pretrained(tmp_path / "b")


def test_missing_pieces(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        flashformer.from_pretrained(tmp_path / "nowhere")
    save_pretrained(tiny_model(), tmp_path / "c", max_shard_bytes=60_000)
    shard = sorted(os.listdir(tmp_path / "c"))[3]
    os.remove(tmp_path / "c" / shard)
    with pytest.raises(CheckpointError, match=f"{shard} not found"):
        flashformer.from_pretrained(tmp_path / "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(CheckpointError, match="lacks the required field 'num_attention_heads'"):
        flashformer.from_pretrained(tmp_path / "d")
    save_pretrained(tiny_model(), tmp_path / "d", format="hf")
    os.replace(tmp_path / "d" / "model.safetensors", tmp_path / "d" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only safetensors"):
        flashformer.from_pretrained(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text('{"format": "flashformer", "model": {"n_layers": 2}}')
    with pytest.raises(CheckpointError, match="did you mean 'n_layer'"):
        flashformer.from_pretrained(tmp_path / "d")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}')
    with pytest.raises(CheckpointError, match="'t5'.*supported: gpt2.*llama.*mistral.*qwen2"):
        flashformer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="o_bias=True contradicts family='qwen2'"):
        save_pretrained(tiny_model(family="qwen2", qkv_bias=True, o_bias=True), tmp_path / "x", format="hf")
    assert not (tmp_path / "x").exists()


def test_atomic_write_file_keeps_old_content_on_failure(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write_file(path, lambda f: f.write(b"old"))

    def failing_write(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_file(path, failing_write)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]
    atomic_write_file(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_signal_as_a_temporary_is_made_leaves_nothing_behind(kind, tmp_path):
    """SIGTERM during setup raises where it lands (train.stops.interrupts_raise); landing just after the temporary
    file or directory of an atomic write exists, but before the write's cleanup knows of it, it still removes it."""
    def make_then_signal(path):
        made = os.mkdir(path) if kind == "directory" else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises as this call returns
        return made

    with pytest.raises(Interrupted), interrupts_raise():
        fileio._create_beside(str(tmp_path), "cache", make_then_signal)
    assert os.listdir(tmp_path) == []


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_atomic_directory_replaces_or_keeps(tmp_path):
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        _write_text(os.path.join(tmp, "a"), "1")
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            _write_text(os.path.join(tmp, "b"), "2")
            raise RuntimeError("crash while writing")
    assert os.listdir(final) == ["a"] and os.listdir(tmp_path) == ["ckpt"]
    with atomic_directory(final) as tmp:
        _write_text(os.path.join(tmp, "b"), "2")
    assert os.listdir(final) == ["b"] and os.listdir(tmp_path) == ["ckpt"]


def test_atomic_directory_keeps_a_cache_another_build_landed_first(tmp_path):
    """Two builds of one keyed cache at once: the one that lands second neither fails nor takes the
    directory away from readers of the first; its own build is discarded."""
    final = tmp_path / "cache"
    with atomic_directory(final, keep_existing=True) as late:
        _write_text(os.path.join(late, "tokens"), "late")
        with atomic_directory(final, keep_existing=True) as early:  # another process finishing first
            _write_text(os.path.join(early, "tokens"), "early")
        assert (final / "tokens").read_text() == "early"
    assert (final / "tokens").read_text() == "early" and os.listdir(tmp_path) == ["cache"]
    # a build that fails still leaves nothing behind, and the landed cache stays
    with pytest.raises(RuntimeError):
        with atomic_directory(final, keep_existing=True) as tmp:
            _write_text(os.path.join(tmp, "tokens"), "partial")
            raise RuntimeError("crash while tokenizing")
    assert (final / "tokens").read_text() == "early" and os.listdir(tmp_path) == ["cache"]


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path / "ckpt")

    class BrokenTokenizer:
        def save(self, directory):
            raise OSError("tokenizer write failed")

    with pytest.raises(OSError, match="tokenizer write failed"):
        save_pretrained(tiny_model(n_layer=1), tmp_path / "ckpt", tokenizer=BrokenTokenizer())
    assert torch.equal(logits(flashformer.from_pretrained(tmp_path / "ckpt")), logits(model))
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_read_of_a_sharded_transformers_checkpoint_equals_whole_file_loads(tmp_path, dtype):
    """read_weights (one tensor at a time through safe_open, converted as read) equals safetensors' load_file
    of every shard, then converted: same names, dtypes and bits; from_pretrained holds the same values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flashformer.weights import read_weights

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2))
    hf_model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    whole = {}
    for shard in shards:
        whole.update(load_file(tmp_path / shard))
    expected = {name: t.to(dtype) if dtype is not None else t for name, t in whole.items()}
    streamed = read_weights(tmp_path, dtype)
    assert streamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name
    loaded = flashformer.from_pretrained(tmp_path, dtype=dtype)
    ours = loaded.state_dict()
    assert torch.equal(ours["embed.weight"], expected["model.embed_tokens.weight"])
    assert torch.equal(ours["blocks.1.mlp.down_proj.weight"], expected["model.layers.1.mlp.down_proj.weight"])
