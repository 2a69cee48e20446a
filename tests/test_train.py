"""flashformer.train and flashformer.cli: the loop, checkpoints and resume, fine-tuning, bad input."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from flashformer.checkpoint import from_pretrained
from flashformer.cli import main as cli_main
from flashformer.config import ConfigError
from flashformer.data import DataError
from flashformer.model import Transformer
from flashformer.tokenizer import load_tokenizer, train_bpe
from flashformer.train import (
    TRAINER_STATE_FILE,
    OptimConfig,
    Trainer,
    latest_checkpoint,
    load_train_config,
    abridged,
    lr_factor,
    read_metrics,
    train,
)
from test_cli import run as run_here  # the command in this process, where its process is not what is tested


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train fastest on one thread, and do not stall when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One token cache directory shared by every run of the session (tokenized once)."""
    return str(tmp_path_factory.mktemp("data-cache"))


def tiny_recipe(out_dir, cache_dir, **fields) -> dict:
    """A recipe that trains a 2 x 64 byte-level model on 300 kB of the stdlib in about a second."""
    recipe = {
        "name": "test", "out_dir": str(out_dir), "steps": 12, "batch_size": 8, "micro_batch_size": 4,
        "log_every": 1, "eval_every": 4, "eval_batches": 2, "ckpt_every": 4,
        "model": {"vocab_size": 257, "d_model": 64, "n_layer": 2, "n_head": 4, "max_seq_len": 64},
        "data": {"stdlib_max_bytes": 300_000, "seq_len": 32, "cache_dir": cache_dir},
        "optim": {"warmup_steps": 2},
        "sample": {"max_new_tokens": 0},
    }
    for key, value in fields.items():
        section, _, name = key.partition("__")
        if name:
            recipe[section] = {**recipe[section], name: value}
        else:
            recipe[key] = value
    return recipe


def losses(run_dir):
    """Every (step, loss / eval_loss) record of a run, in order."""
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(run_dir)]


def write_recipe(path, recipe):
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def cli_command(*args):
    return [sys.executable, "-m", "flashformer.cli", *args]


SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_factor(0, cfg, 100) == pytest.approx(0.1)
    assert lr_factor(9, cfg, 100) == pytest.approx(1.0)
    assert lr_factor(55, cfg, 100) == pytest.approx(0.55)
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)


def test_a_run_writes_config_metrics_plot_and_checkpoints(tmp_path, data_cache, capsys):
    result = train(load_train_config(tiny_recipe(tmp_path / "run", data_cache, keep_checkpoints=2,
                                                 sample__max_new_tokens=20)))
    assert (result.step, result.interrupted) == (12, False)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-12", "ckpt-8"]
    assert (run / "loss.png").exists()
    assert load_train_config(str(run / "config.yaml")).model.d_model == 64
    records = losses(run)
    assert [step for step, loss, _ in records if loss is not None] == list(range(1, 13))
    assert [step for step, _, eval_loss in records if eval_loss is not None] == [4, 8, 12]
    assert records[-2][1] < records[0][1] - 0.5  # it learns
    out = capsys.readouterr().out
    assert "d_model: 64" in out and "--- sample (prompt 'def ') ---" in out
    model = from_pretrained(run / "ckpt-12")
    state = torch.load(run / "ckpt-12" / TRAINER_STATE_FILE, weights_only=True)
    assert (state["step"], state["data_position"]) == (12, 96)
    assert model.config.n_layer == 2


def test_optimizer_decays_only_matrices(tmp_path, data_cache):
    trainer = Trainer(load_train_config(tiny_recipe(tmp_path, data_cache, attn_backend="sdpa", deterministic=False)))
    assert (trainer.model.attn_backend, trainer.model.deterministic) == ("sdpa", False)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 5  # 2 norms per block + the final norm


def test_sigkill_then_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path, data_cache):
    recipe = tiny_recipe(tmp_path / "reference", data_cache, steps=30, ckpt_every=10, eval_every=10)
    train(load_train_config(recipe))  # the uninterrupted run, and the shared data cache
    killed_dir = tmp_path / "killed"
    config = write_recipe(tmp_path / "recipe.yaml", {**recipe, "out_dir": str(killed_dir)})
    process = subprocess.Popen(cli_command("train", config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=SUBPROCESS_ENV)
    deadline = time.time() + 300
    while not (killed_dir / "ckpt-10").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert latest_checkpoint(str(killed_dir)) != str(killed_dir / "ckpt-30"), "the run ended before the kill"
    resumed = run_here("train", "--resume", str(killed_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    assert losses(killed_dir) == losses(tmp_path / "reference")


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_and_exits_with_the_shells_code(tmp_path, data_cache, sig, exit_code):
    run = tmp_path / "run"
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(run, data_cache, steps=100_000, ckpt_every=100_000))
    process = subprocess.Popen(cli_command("train", config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=SUBPROCESS_ENV)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or os.path.getsize(run / "metrics.jsonl") == 0:
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.01)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == exit_code, stderr
    assert "Traceback" not in stderr and sig.name in stderr
    checkpoint = latest_checkpoint(str(run))
    assert checkpoint is not None
    last_step = losses(run)[-1][0]
    assert checkpoint.endswith(f"ckpt-{last_step}")


def test_resume_true_in_the_same_out_dir_continues(tmp_path, data_cache):
    train(load_train_config(tiny_recipe(tmp_path, data_cache, steps=4)))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(load_train_config(tiny_recipe(tmp_path, data_cache, steps=8)))
    result = train(load_train_config(tiny_recipe(tmp_path, data_cache, steps=8, resume=True)))
    assert result.step == 8
    assert [step for step, loss, _ in losses(tmp_path) if loss is not None] == list(range(1, 9))


def test_finetune_from_a_checkpoint_with_frozen_parameters(tmp_path, data_cache):
    train(load_train_config(tiny_recipe(tmp_path / "base", data_cache, steps=4)))
    base = from_pretrained(tmp_path / "base" / "ckpt-4")
    recipe = tiny_recipe(tmp_path / "tuned", data_cache, steps=4, init_from=str(tmp_path / "base"),
                         freeze=["embed.*", "blocks.0.*"], model={})
    train(load_train_config(recipe))
    tuned = from_pretrained(tmp_path / "tuned" / "ckpt-4")
    base_state, tuned_state = base.state_dict(), tuned.state_dict()
    for name in base_state:
        frozen = name.startswith(("embed.", "blocks.0."))
        assert torch.equal(base_state[name], tuned_state[name]) == frozen, name
    saved = load_train_config(str(tmp_path / "tuned" / "config.yaml"))
    assert saved.model.d_model == 64  # the model config comes from the checkpoint, not the recipe


def test_finetuning_keeps_the_tokenizer_of_the_checkpoint(tmp_path, data_cache):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    bpe = train_bpe([str(corpus)], 300, str(tmp_path / "bpe.json"))
    base = tiny_recipe(tmp_path / "base", data_cache, steps=2, data__tokenizer=str(tmp_path / "bpe.json"),
                       model__vocab_size=320)
    train(load_train_config(base))
    train(load_train_config(tiny_recipe(tmp_path / "tuned", data_cache, steps=2, init_from=str(tmp_path / "base"))))
    saved = load_train_config(str(tmp_path / "tuned" / "config.yaml"))
    assert saved.data.tokenizer == str(tmp_path / "base" / "ckpt-2" / "tokenizer.json")
    assert load_tokenizer(str(tmp_path / "tuned" / "ckpt-2")).encode("return a") == bpe.encode("return a")


def test_activation_checkpointing_changes_memory_not_losses(tmp_path, data_cache):
    for name, checkpointing in (("plain", False), ("checkpointed", True)):
        recipe = tiny_recipe(tmp_path / name, data_cache, steps=3, activation_checkpointing=checkpointing)
        train(load_train_config(recipe))
    assert losses(tmp_path / "checkpointed") == losses(tmp_path / "plain")


def test_chunked_loss_trains_like_full_logits(tmp_path, data_cache, monkeypatch):
    """chunked_loss goes through the model's forward (as DDP / FSDP call it) and never builds the
    (tokens x vocab) logits; its losses equal the full-logits path's up to fp32 rounding."""
    runs = {}
    for name, chunked in (("full", False), ("chunked", True)):
        recipe = tiny_recipe(tmp_path / name, data_cache, steps=3, chunked_loss=chunked)
        train(load_train_config(recipe))
        runs[name] = losses(tmp_path / name)
    for (step, loss, eval_loss), (step_c, loss_c, eval_loss_c) in zip(runs["full"], runs["chunked"]):
        assert step == step_c
        assert (loss is None) == (loss_c is None) and (eval_loss is None) == (eval_loss_c is None)
        for a, b in ((loss, loss_c), (eval_loss, eval_loss_c)):
            assert a is None or abs(a - b) < 1e-4
    # The trainer materializes logits only when not chunking: the LM head's full output never appears.
    seen = []
    monkeypatch.setattr(Transformer, "forward", _recording_forward(Transformer.forward, seen))
    train(load_train_config(tiny_recipe(tmp_path / "again", data_cache, steps=1, chunked_loss=True)))
    assert seen and all(kind == "loss" for kind in seen)


def _recording_forward(forward, seen):
    def record(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append("loss" if out.dim() == 0 else "logits")
        return out
    return record


def test_packed_batches_train(tmp_path, data_cache):
    result = train(load_train_config(tiny_recipe(tmp_path, data_cache, steps=3, data__packing="packed",
                                                 data__stdlib_max_bytes=1_000_000)))
    assert result.train_loss < 5.6


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1e-3", "unknown config key 'optim.lrr'.*did you mean 'lr'"),
    ("stepz=3", "unknown config key 'stepz'.*did you mean 'steps'"),
    ("steps=0", "steps must be >= 1"),
    ("optim.min_lr=1.0", "min_lr <= lr"),
    ("batch_size=6", "multiple of micro_batch_size"),
    ("data.seq_len=128", "exceeds model.max_seq_len"),
    ("data.packing=zigzag", "expected one of"),
    ("steps=many", "steps: expected int"),
    ("model.d_model=130", "d_model=130 is not a multiple of n_head=4"),
])
def test_invalid_configs_name_the_problem(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(tiny_recipe(tmp_path, "unused"), [override])


@pytest.mark.parametrize("fields, error, message", [
    ({"data__source": "files", "data__train_files": ["missing/*.txt"]}, DataError, "no file matches"),
    ({"out_dir": "FILE/run"}, ConfigError, "out_dir 'FILE/run' is not writable: Not a directory; choose another"),
    pytest.param({"out_dir": "/sys/flashformer-run"}, ConfigError, "out_dir '/sys/flashformer-run' is not writable",
                 marks=pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysfs: read-only to mkdir")),
    ({"init_from": "no/such/checkpoint"}, ConfigError, "init_from"),
    ({"freeze": ["encoder.*"]}, ConfigError, "matches no parameter"),
    ({"model__vocab_size": 200}, ConfigError, "tokenizer has 257 tokens"),
    ({"data__tokenizer": "missing.json"}, ConfigError, "does not exist"),
])
def test_bad_input_fails_before_the_first_step(tmp_path, data_cache, monkeypatch, fields, error, message):
    (tmp_path / "FILE").write_text("a file where a directory should be")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Trainer, "train_step", lambda self: pytest.fail("a training step ran"))
    out_dir = fields.pop("out_dir", str(tmp_path / "run"))
    with pytest.raises(error, match=message):
        train(load_train_config(tiny_recipe(out_dir, data_cache, **fields)))
    assert not os.path.exists(out_dir), "a run that never started left its directory behind"


def test_cli_train_overrides_generate_and_tokenizer(tmp_path, data_cache, capsys):
    config = write_recipe(tmp_path / "recipe.yaml", tiny_recipe(tmp_path / "run", data_cache))
    assert cli_main(["train", config, "steps=2", "optim.lr=3e-4"]) == 0
    saved = load_train_config(str(tmp_path / "run" / "config.yaml"))
    assert (saved.steps, saved.optim.lr) == (2, 3e-4)
    assert cli_main(["train", config, "optim.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert cli_main(["generate", str(tmp_path / "run" / "ckpt-2"), "--prompt", "import", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("import")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 50)
    assert cli_main(["tokenizer", "train", "--files", str(corpus), "--vocab-size", "300", "--out",
                     str(tmp_path / "tok.json")]) == 0
    assert (tmp_path / "tok.json").exists()


def test_recipes_load_and_reference_model_files():
    root = os.path.join(os.path.dirname(__file__), "..", "configs")
    tiny = load_train_config(os.path.join(root, "tiny.yaml"))
    assert tiny.data.source == "stdlib" and tiny.run_dir == os.path.join("runs", "tiny")
    gpt2 = load_train_config(os.path.join(root, "gpt2-124m.yaml"), ["model.n_layer=2"])
    assert (gpt2.model.family, gpt2.model.d_model, gpt2.model.n_layer) == ("gpt2", 768, 2)
    assert load_train_config(os.path.join(root, "llama-125m.yaml")).model.n_kv_head == 4


def test_the_console_config_cuts_long_lists_only():
    files = [f"doc-{i}.txt" for i in range(600)]
    shown = abridged({"data": {"train_files": files, "eval_files": files[:6]}, "steps": 3})
    assert shown["data"]["train_files"][:3] == files[:3] and len(shown["data"]["train_files"]) == 4
    assert "597 more" in shown["data"]["train_files"][3]
    assert shown["data"]["eval_files"] == files[:6] and shown["steps"] == 3


def test_a_bf16_checkpoint_fine_tunes_on_fp32_master_weights(tmp_path, data_cache):
    """A bf16 Hugging Face checkpoint trains fp32 weights and AdamW moments (bf16 is the autocast's), so an
    update far below bf16's resolution (~1e-4 at these weights) still moves every weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf-bf16")
    recipe = tiny_recipe(tmp_path / "run", data_cache, init_from=str(tmp_path / "hf-bf16"), steps=1,
                         optim__lr=1e-6, optim__min_lr=1e-7, optim__weight_decay=0.0)
    trainer = Trainer(load_train_config(recipe))
    try:
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        assert {p.dtype for p in before.values()} == {torch.float32}
        torch.testing.assert_close(before["embed.weight"].cpu(), hf.model.embed_tokens.weight.float(), rtol=0, atol=0)
        trainer.train_step()
        assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.float32}
        unmoved = [name for name, p in trainer.model.named_parameters() if torch.equal(p, before[name])]
        assert not unmoved, unmoved
    finally:
        trainer.close()
