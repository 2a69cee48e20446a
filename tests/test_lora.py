"""flashformer.lora and activation checkpointing with host offload: adapters on a frozen base, their
checkpoints, resume and merge, and the gradients of the checkpointing policies."""

import copy
import inspect
import json
import json.decoder
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from flashformer import parallel
from flashformer.batches import Batch
from flashformer.checkpoint import from_pretrained, load_adapted
from flashformer.cli import main as cli_main
from flashformer.config import ConfigError
from flashformer.lora import LoRAConfig, LoRALinear, apply_lora, merge_lora
from flashformer.model import ModelConfig, Transformer
from flashformer.parallel import DistributedEnv, ParallelConfig, apply_activation_checkpointing, parallelize
from flashformer.tokenizer import ByteTokenizer
from flashformer.train import OptimConfig, Trainer, latest_checkpoint, load_train_config, read_metrics, train
from flashformer.train.step import build_optimizer, train_step
from flashformer.weights import ADAPTER_CONFIG_FILE, ADAPTER_FILE, SINGLE_FILE, CheckpointError
from test_train import data_cache, losses, one_thread, tiny_recipe  # noqa: F401 (fixtures)

TINY = ModelConfig(vocab_size=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96, max_seq_len=64)
ADAPTED = ("lora_a", "lora_b")


def tokens(batch=2, seqlen=16):
    return torch.randint(0, TINY.vocab_size, (batch, seqlen))


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data_cache):  # noqa: F811
    """A 12-step full training run: the base the LoRA runs adapt."""
    run = tmp_path_factory.mktemp("base") / "run"
    train(load_train_config(tiny_recipe(run, data_cache)))
    return str(run)


def lora_recipe(out_dir, cache_dir, base_dir, **fields):
    recipe = tiny_recipe(out_dir, cache_dir, init_from=base_dir, **fields)
    recipe.setdefault("lora", {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "up"]})
    recipe["optim"] = {**recipe["optim"], "lr": 1e-2, "min_lr": 1e-3}
    return recipe


def test_the_adapted_model_starts_equal_to_its_base_and_only_adapters_get_gradients():
    model = Transformer(TINY)
    ids = tokens()
    with torch.no_grad():
        expected = model(ids)
    apply_lora(model, LoRAConfig(rank=4, targets=["q", "v", "down"]))
    assert torch.equal(model(ids), expected)
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"blocks.{i}.{path}.{part}" for i in range(2)
                               for path in ("attn.q_proj", "attn.v_proj", "mlp.down_proj") for part in ADAPTED)
    model(ids).float().logsumexp(-1).mean().backward()
    assert sorted(name for name, p in model.named_parameters() if p.grad is not None) == trainable
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_train_norms_adds_only_the_norms():
    model = apply_lora(Transformer(TINY), LoRAConfig(rank=2, train_norms=True))
    extra = sorted(name for name, p in model.named_parameters() if p.requires_grad and not name.endswith(ADAPTED))
    assert extra == ["blocks.0.attn_norm.weight", "blocks.0.mlp_norm.weight", "blocks.1.attn_norm.weight",
                     "blocks.1.mlp_norm.weight", "final_norm.weight"]


def test_the_bf16_base_is_adopted_not_copied(tmp_path):
    Transformer(TINY).save_pretrained(tmp_path / "base")
    model = from_pretrained(tmp_path / "base", dtype="bf16")
    loaded = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    apply_lora(model, LoRAConfig(rank=4))
    params = dict(model.named_parameters())
    for name, (param, pointer) in loaded.items():
        assert params[name] is param and param.data_ptr() == pointer and param.dtype == torch.bfloat16
        assert not param.requires_grad
    assert {p.dtype for name, p in params.items() if name.endswith(ADAPTED)} == {torch.float32}


def test_the_loss_goes_down_on_stdlib_source(base_run):
    model = apply_lora(from_pretrained(base_run + "/ckpt-12"), LoRAConfig(rank=8, alpha=16.0))
    rows = torch.tensor(ByteTokenizer().encode(inspect.getsource(json.decoder))[:4 * 33]).view(4, 33)
    batch = Batch(rows[:, :-1], rows[:, 1:])
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.0))
    step_losses = [train_step(model, optimizer, [batch])[0].item() for _ in range(15)]
    assert step_losses[-1] < step_losses[0] - 0.1, step_losses


def test_a_bf16_lora_run_keeps_no_fp32_copy_of_the_base_and_optimizes_only_the_adapters(tmp_path, data_cache,  # noqa: F811
                                                                                         base_run):
    trainer = Trainer(load_train_config(lora_recipe(tmp_path / "run", data_cache, base_run, precision="bf16",
                                                    steps=1)))
    try:
        frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
        adapters = {id(p) for name, p in trainer.model.named_parameters() if name.endswith(ADAPTED)}
        optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        assert {id(p) for p in optimized} == adapters and len(optimized) == len(adapters)
        trainer.train_step()
        assert {id(p) for p in trainer.optimizer.state} == adapters
        assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    finally:
        trainer.close()


def test_lora_learns_saves_only_adapters_and_merges_to_the_adapted_logits(tmp_path, data_cache, base_run):  # noqa: F811
    run = tmp_path / "run"
    train(load_train_config(lora_recipe(run, data_cache, base_run, sample__max_new_tokens=8)))
    assert all(math.isfinite(loss) for _, loss, _ in losses(run) if loss is not None)
    checkpoint = latest_checkpoint(str(run))
    assert (run / "ckpt-12" / ADAPTER_FILE).exists() and not (run / "ckpt-12" / SINGLE_FILE).exists()
    assert (run / "ckpt-12" / ADAPTER_CONFIG_FILE).exists()

    adapted, merged = load_adapted(checkpoint), from_pretrained(checkpoint)
    assert any(isinstance(m, LoRALinear) for m in adapted.modules())
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    ids = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), adapted(ids), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(ids), from_pretrained(base_run + "/ckpt-12")(ids))

    out = tmp_path / "merged"
    assert cli_main(["merge-lora", checkpoint, "--out", str(out)]) == 0
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(out)(ids), merged(ids), rtol=0, atol=0)
    assert cli_main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    hf_out = tmp_path / "merged-hf"
    assert cli_main(["merge-lora", checkpoint, "--out", str(hf_out), "--format", "hf"]) == 0
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(hf_out)(ids), merged(ids), rtol=1e-5, atol=1e-5)


def test_a_resumed_lora_run_reproduces_the_uninterrupted_losses(tmp_path, data_cache, base_run):  # noqa: F811
    reference = tmp_path / "reference"
    train(load_train_config(lora_recipe(reference, data_cache, base_run, keep_checkpoints=3)))
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "ckpt-12")
    result = train(load_train_config(resume_dir=str(resumed)))
    assert result.step == 12
    assert losses(resumed) == losses(reference)
    assert [r["step"] for r in read_metrics(resumed) if "loss" in r] == list(range(1, 13))


def test_a_hugging_face_base_adapts_and_a_moved_base_is_named(tmp_path, data_cache, base_run):  # noqa: F811
    base = tmp_path / "hf-base"
    base_model = from_pretrained(base_run + "/ckpt-12")
    base_model.save_pretrained(base, format="hf")
    run = tmp_path / "run"
    train(load_train_config(lora_recipe(run, data_cache, str(base), steps=1)))
    adapter = latest_checkpoint(str(run))
    ids = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(adapter)(ids), load_adapted(adapter)(ids), rtol=1e-5, atol=1e-5)
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match="not there any more"):
        from_pretrained(adapter)


def _gradients(model, ids, targets):
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_offloaded_checkpointing_gives_the_gradients_of_plain_checkpointing_and_of_none(monkeypatch, lora):
    offloaded_inputs = []

    class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory):
            super().__init__(pin_memory)
            pack = self.pack_hook

            def counting_pack(tensor):
                if tensor.numel():  # some torch versions' checkpoint also saves an empty placeholder tensor
                    offloaded_inputs.append(tuple(tensor.shape))
                return pack(tensor)

            self.pack_hook = counting_pack

    monkeypatch.setattr(parallel, "save_on_cpu", CountingSaveOnCpu)
    base = Transformer(TINY)
    if lora:
        apply_lora(base, LoRAConfig(rank=4))
        for name, p in base.named_parameters():  # B away from zero, so that A's gradient is not zero
            if name.endswith("lora_b"):
                torch.nn.init.normal_(p)
    models = {mode: copy.deepcopy(base) for mode in ("none", "plain", "offload")}
    apply_activation_checkpointing(models["plain"])
    apply_activation_checkpointing(models["offload"], offload=True)
    ids, targets = tokens(), tokens()
    grads = {mode: _gradients(model, ids, targets) for mode, model in models.items()}
    assert offloaded_inputs == [(2, 16, TINY.d_model)] * TINY.n_layer  # the block inputs, nothing else
    assert grads["plain"].keys() == grads["none"].keys() and len(grads["none"]) > 0
    for name in grads["none"]:
        assert torch.equal(grads["offload"][name], grads["plain"][name]), name
        torch.testing.assert_close(grads["offload"][name], grads["none"][name], rtol=1e-6, atol=1e-7)


def test_merge_folds_the_adapters_into_the_weights():
    model = apply_lora(Transformer(TINY), LoRAConfig(rank=4, alpha=4.0, targets=["q"]))
    layer = model.blocks[0].attn.q_proj
    torch.nn.init.normal_(layer.lora_b)
    expected = layer.weight + layer.lora_b @ layer.lora_a
    merge_lora(model)
    assert isinstance(model.blocks[0].attn.q_proj, torch.nn.Linear)
    torch.testing.assert_close(model.blocks[0].attn.q_proj.weight, expected.detach())
    assert set(model.state_dict()) == set(Transformer(TINY).state_dict())


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=-1"], "lora.rank must be >= 0"),
    (["lora.rank=4", "lora.targets=[q, x]"], "lora.targets="),
    (["lora.rank=4", "lora.dropout=1.0"], "lora.dropout"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha"),
    (["lora.rank=4", "lora.base_dtype=fp16"], "lora.base_dtype"),
    (["lora.rank=4"], "set init_from"),
    (["lora.rank=4", "init_from=x", "freeze=[embed.weight]"], "freeze cannot be combined with lora.rank"),
    (["lora.rank=4", "init_from=x", "precision=fp32", "lora.base_dtype=bf16"], "lora.base_dtype=bf16 needs bf16"),
    (["activation_checkpointing=disk"], "activation_checkpointing"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_train_config(None, overrides)


def test_offload_with_compile_and_a_missing_target_are_refused():
    env = DistributedEnv(0, 0, 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match="activation_checkpointing=offload cannot be combined with compile"):
        parallelize(Transformer(TINY), ParallelConfig(), env, activation_checkpointing="offload", compile=True)
    gpt2 = Transformer(ModelConfig(family="gpt2", vocab_size=64, d_model=64, n_layer=1, n_head=4, max_seq_len=32))
    with pytest.raises(ConfigError, match="lora.targets: 'gate' names no layer"):
        apply_lora(gpt2, LoRAConfig(rank=2, targets=["gate"]))


def test_an_offloaded_cpu_run_matches_plain_checkpointing(tmp_path, data_cache, base_run):  # noqa: F811
    for mode in (True, "offload"):
        train(load_train_config(lora_recipe(tmp_path / str(mode), data_cache, base_run, steps=4,
                                            activation_checkpointing=mode)))
    assert losses(tmp_path / "offload") == losses(tmp_path / "True")


def test_finetune_long_trains_adapters_with_offloaded_checkpointing(tmp_path, base_run):
    out_dir = tmp_path / "long"
    exit_code = cli_main(["finetune-long", base_run, "--target-len", "128", "--steps", "2", "--eval-windows", "1",
                          "--passkey-trials", "1", "--eval-lengths", "64", "128", "--out-dir", str(out_dir),
                          "eval_every=2", "ckpt_every=2", "lora.rank=4", "activation_checkpointing=offload"])
    assert exit_code == 0
    report = json.loads((out_dir / "long_context_report.json").read_text())
    finetuned = report["finetuned_checkpoint"]
    assert (tmp_path / "long" / "ckpt-2" / ADAPTER_FILE).exists() and finetuned.endswith("ckpt-2")
    config = load_train_config(str(out_dir / "config.yaml"))
    assert (config.lora.rank, config.activation_checkpointing, config.data.seq_len) == (4, "offload", 128)
    assert from_pretrained(finetuned).config.max_seq_len == 128
