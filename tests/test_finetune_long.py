"""flashformer.longctx: RoPE extension configs, passkey prompts, perplexity, the end-to-end command."""

import contextlib
import io
import json
import math
import re
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashformer import batches as batches_module
from flashformer.checkpoint import from_pretrained
from flashformer.cli import main as cli_main
from flashformer.config import ConfigError
from flashformer.data import DataConfig, DataError, TokenCorpus, load_corpus
from flashformer.longctx import (
    CLAIM_DEGRADATION,
    MARKDOWN_FILE,
    MODELS,
    PLOT_FILE,
    REPORT_FILE,
    SCALINGS,
    build_passkey_prompt,
    extended_model_config,
    extension_claim,
    held_out_windows,
    markdown_report,
    mix_in_passkey_documents,
    passkey_prompts,
    perplexity,
)
from flashformer.model import ModelConfig, Transformer
from flashformer.tokenizer import ByteTokenizer
from flashformer.train import latest_checkpoint, load_train_config, train

ORIGINAL_LEN, TARGET_LEN = 64, 256


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and do not stall when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread_per_test():
    with one_thread():
        yield


def tiny_config(**fields) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 257, "d_model": 64, "n_layer": 2, "n_head": 4,
                          "max_seq_len": ORIGINAL_LEN, **fields})


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A byte-level model trained for 12 steps at context 64 on 300 kB of the stdlib."""
    root = tmp_path_factory.mktemp("finetune-long")
    recipe = {
        # On the CPU (finetune-long inherits it): the report's perplexities are checked against fp32 CPU
        # recomputations to rel 1e-7, and device "auto" would evaluate on CUDA under bf16 autocast.
        "device": "cpu",
        "name": "base", "out_dir": str(root / "base"), "steps": 12, "batch_size": 8, "micro_batch_size": 4,
        "log_every": 4, "eval_every": 12, "eval_batches": 2, "ckpt_every": 12,
        "model": {"vocab_size": 257, "d_model": 64, "n_layer": 2, "n_head": 4, "max_seq_len": ORIGINAL_LEN},
        "data": {"stdlib_max_bytes": 300_000, "seq_len": ORIGINAL_LEN, "cache_dir": str(root / "cache")},
        "optim": {"warmup_steps": 2},
        "sample": {"max_new_tokens": 0},
    }
    with one_thread():
        train(load_train_config(recipe))
    return root


@pytest.fixture(scope="module")
def extended_run(base_run):
    """``flashformer finetune-long`` 64 -> 256 with linear scaling for 4 steps; records the training batches."""
    seen_batches = []
    original_next_step = batches_module.TrainBatches.next_step

    def recording_next_step(self):
        batches = original_next_step(self)
        seen_batches.extend(batches)
        return batches

    out_dir = base_run / "long"
    stdout = io.StringIO()
    with one_thread(), pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(batches_module.TrainBatches, "next_step", recording_next_step)
        exit_code = cli_main(["finetune-long", str(base_run / "base"), "--target-len", str(TARGET_LEN),
                              "--scaling", "linear", "--steps", "4", "--eval-windows", "2", "--passkey-trials", "1",
                              "--out-dir", str(out_dir), "eval_every=4", "ckpt_every=4"])
    return {"exit_code": exit_code, "out_dir": out_dir, "stdout": stdout.getvalue(), "batches": seen_batches}


def test_the_report_has_every_model_length_and_metric_and_ends_with_the_verdict(extended_run):
    assert extended_run["exit_code"] == 0
    report = json.loads((extended_run["out_dir"] / REPORT_FILE).read_text())
    assert [row["length"] for row in report["lengths"]] == [64, 128, 256]
    for row in report["lengths"]:
        assert all(math.isfinite(row[f"ppl_{model}"]) for model in MODELS)
    # A 64-token context cannot hold the needle and the question; the longer ones can.
    assert all(report["lengths"][0][f"passkey_{model}"] is None for model in MODELS)
    assert all(0.0 <= row[f"passkey_{model}"] <= 1.0 for row in report["lengths"][1:] for model in MODELS)
    assert (report["original_length"], report["target_length"], report["steps"]) == (64, 256, 4)
    assert report["claim"] == extension_claim(report["lengths"], 64, 256)
    assert (extended_run["out_dir"] / PLOT_FILE).exists()
    assert re.search(r"expected time on this machine: ~\d+ (s|min) \(fine-tuning 4 steps x [\d.]+ s, "
                     r"evaluation ~\d+ (s|min):", extended_run["stdout"])
    printed = extended_run["stdout"].rstrip().splitlines()[-7:]
    assert printed[0] == ("| length | ppl original | ppl linear (no fine-tune) | ppl linear + fine-tune | passkey "
                          "original | passkey linear (no fine-tune) | passkey linear + fine-tune |")
    assert [line.split("|")[1].strip() for line in printed[2:5]] == ["64", "128", "256"]
    assert printed[5] == "" and printed[6].startswith(("PASS: ", "FAIL: "))
    assert (extended_run["out_dir"] / MARKDOWN_FILE).read_text().splitlines() == printed


def test_original_is_the_unscaled_checkpoint_and_scaled_the_extended_one_before_fine_tuning(base_run, extended_run):
    """The claim compares the model as trained with the fine-tuned one: recompute both reference rows."""
    report = json.loads((extended_run["out_dir"] / REPORT_FILE).read_text())
    data = load_train_config(str(extended_run["out_dir"] / "config.yaml")).data
    windows = held_out_windows(load_corpus(data, ByteTokenizer())[1], [64, 128, 256], report["eval_windows"])
    original = from_pretrained(latest_checkpoint(str(base_run / "base")))
    scaled = from_pretrained(str(extended_run["out_dir"] / "extended-init"))
    assert original.config.rope_scaling is None and scaled.config.rope_scaling["factor"] == 4.0
    # Same windows, batches and thread count: equal to rounding. The 12-step model barely uses
    # positions, so the two models differ by ~1e-5 relative: the tolerance must be far below that.
    for row in report["lengths"]:
        assert row["ppl_original"] == pytest.approx(perplexity(original, windows[row["length"]], 4), rel=1e-7)
        assert row["ppl_scaled"] == pytest.approx(perplexity(scaled, windows[row["length"]], 4), rel=1e-7)
        assert row["ppl_scaled"] != pytest.approx(row["ppl_original"], rel=1e-7)


def test_the_claim_needs_the_finetuned_model_no_worse_and_the_original_far_worse():
    def rows(original_at_l, original_at_n, finetuned_at_n, finetuned_at_l=99.0):
        return [{"length": 64, "ppl_original": original_at_l, "ppl_finetuned": finetuned_at_l},
                {"length": 256, "ppl_original": original_at_n, "ppl_finetuned": finetuned_at_n}]

    passed = extension_claim(rows(3.0, 30.0, 2.9), 64, 256)
    assert passed["passed"] and passed["finetuned_uses_context"]  # 2.9 @ 256 <= 99.0 @ 64
    # Reported beside the claim, not part of it: fine-tuning may lower the perplexity at L more than at N.
    short_better = extension_claim(rows(3.0, 30.0, 2.9, finetuned_at_l=2.5), 64, 256)
    assert short_better["passed"] and not short_better["finetuned_uses_context"]
    finetuned_worse = extension_claim(rows(3.0, 30.0, 3.1), 64, 256)
    assert finetuned_worse["original_degrades"] and not finetuned_worse["finetuned_no_worse"]
    assert not finetuned_worse["passed"]
    original_fine = extension_claim(rows(3.0, 3.0 * CLAIM_DEGRADATION, 2.9), 64, 256)
    assert original_fine["finetuned_no_worse"] and not original_fine["original_degrades"]
    assert not original_fine["passed"]
    assert extension_claim(rows(3.0, 30.0, 2.9), 32, 256) is None  # L was not evaluated
    row = {"length": 64, **{f"ppl_{model}": 3.0 for model in MODELS}, **{f"passkey_{model}": None for model in MODELS}}
    report = {"scaling": "linear", "original_length": 64, "target_length": 512, "lengths": [row], "claim": None}
    assert markdown_report(report).endswith("the evaluated lengths must include the original context 64 "
                                            "and the target 512")


def test_the_finetuned_checkpoint_is_extended_and_loads(extended_run):
    checkpoint = latest_checkpoint(str(extended_run["out_dir"]))
    assert os.path.basename(checkpoint) == "ckpt-4"
    config = json.loads(open(os.path.join(checkpoint, "config.json")).read())["model"]
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["max_seq_len"] == TARGET_LEN
    model = from_pretrained(checkpoint)
    assert model.config.max_seq_len == TARGET_LEN
    assert model(torch.zeros(1, TARGET_LEN, dtype=torch.long)).shape == (1, TARGET_LEN, 257)


def test_training_ran_on_packed_rows_of_the_target_length_with_activation_checkpointing(extended_run):
    batches = extended_run["batches"]
    assert len(batches) == 4 * 2  # 4 steps x 2 micro batches
    assert all(b.cu_seqlens is not None and b.input_ids.shape[1] == TARGET_LEN for b in batches)
    run_config = load_train_config(str(extended_run["out_dir"] / "config.yaml"))
    assert run_config.data.packing == "packed" and run_config.data.seq_len == TARGET_LEN
    assert run_config.activation_checkpointing
    assert run_config.init_from == str(extended_run["out_dir"] / "extended-init")


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_passkey_prompt_hides_the_key_at_the_requested_depth(depth):
    tokenizer = ByteTokenizer()
    prompt = build_passkey_prompt(tokenizer, 1024, depth, "48213")
    assert len(prompt.prompt_ids) + len(prompt.answer_ids) <= 1024
    assert len(prompt.prompt_ids) + len(prompt.answer_ids) > 1024 - 25  # filled up to about one sentence
    assert abs(prompt.needle_start / len(prompt.prompt_ids) - depth) < 0.03
    needle_text = tokenizer.decode(prompt.prompt_ids[prompt.needle_start:]).lstrip()
    assert needle_text.startswith("The pass key is 48213. Remember it.")
    assert tokenizer.decode(prompt.prompt_ids).endswith("The pass key is")
    assert tokenizer.decode(prompt.answer_ids) == " 48213"
    assert tokenizer.decode(prompt.prompt_ids).count("48213") == 2  # only in the needle


def test_passkey_prompts_are_reproducible_and_skip_lengths_too_short():
    tokenizer = ByteTokenizer()
    first = passkey_prompts(tokenizer, 512, [0.2, 0.8], trials=3, seed=7)
    assert [p.passkey for p in first] == [p.passkey for p in passkey_prompts(tokenizer, 512, [0.2, 0.8], 3, 7)]
    assert [p.depth for p in first] == [0.2] * 3 + [0.8] * 3
    assert passkey_prompts(tokenizer, 64, [0.5], trials=2, seed=7) == []


def test_perplexity_is_exp_of_the_mean_cross_entropy_of_the_windows():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    rng = np.random.default_rng(0)
    corpus = TokenCorpus(rng.integers(0, 256, 900).astype(np.uint16), np.array([0, 90, 500, 900]))
    windows = held_out_windows(corpus, [32, 96], count=6)
    # Chunks of 97 tokens from document starts on: none in the 90-token document, and none across
    # the boundary at 500 (the fifth chunk of the second document would end at 575).
    starts = [90, 187, 284, 381, 500, 597]
    assert windows[96].tolist() == [corpus.tokens[s : s + 97].tolist() for s in starts]
    assert torch.equal(windows[32], windows[96][:, :33])
    one_window = windows[96][:1]
    with torch.no_grad():
        logits = model(one_window[:, :-1])
        expected = math.exp(F.cross_entropy(logits.flatten(0, 1), one_window[:, 1:].flatten()).item())
        logits = model(windows[32][:, :-1])
        expected_all = math.exp(F.cross_entropy(logits.flatten(0, 1), windows[32][:, 1:].flatten()).item())
    assert perplexity(model, one_window, batch_size=1) == pytest.approx(expected, rel=1e-5)
    assert perplexity(model, windows[32], batch_size=4) == pytest.approx(expected_all, rel=1e-5)


@pytest.mark.parametrize("scaling", ["linear", "yarn", "llama3", "ntk"])
def test_each_scaling_gives_a_valid_extended_config(scaling):
    config = extended_model_config(tiny_config(), TARGET_LEN, scaling)
    Transformer(config)  # validates the rope_scaling dict
    assert config.max_seq_len == TARGET_LEN
    if scaling == "ntk":
        assert config.rope_scaling is None and config.rope_theta == pytest.approx(10000 * 4 ** (16 / 14))
    else:
        assert config.rope_scaling["rope_type"] == scaling and config.rope_scaling["factor"] == 4.0
    if scaling in ("yarn", "llama3"):
        assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL_LEN


def test_bad_scalings_and_lengths_are_refused():
    with pytest.raises(ConfigError, match="valid are " + ", ".join(SCALINGS)):
        extended_model_config(tiny_config(), TARGET_LEN, "rope-magic")
    with pytest.raises(ConfigError, match="must exceed the model's context 64"):
        extended_model_config(tiny_config(), ORIGINAL_LEN, "linear")
    with pytest.raises(ConfigError, match="would never engage"):
        extended_model_config(tiny_config(), TARGET_LEN, "dynamic")
    with pytest.raises(ConfigError, match="only RoPE models"):
        extended_model_config(tiny_config(pos="learned"), TARGET_LEN, "linear")


def test_bad_input_fails_before_anything_is_written(base_run, tmp_path, capsys):
    out_dir = tmp_path / "never"
    common = ["--out-dir", str(out_dir), "--steps", "2"]
    assert cli_main(["finetune-long", str(base_run / "base"), "--target-len", "64", *common]) == 2
    assert "target length 64 must exceed the model's context 64" in capsys.readouterr().err
    assert cli_main(["finetune-long", str(tmp_path / "missing"), "--target-len", "256", *common]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["finetune-long", str(base_run / "base"), "--target-len", "256", "--scaling", "rope-magic", *common])
    assert exit_info.value.code == 2
    assert "choose from linear, dynamic, yarn, llama3, ntk" in capsys.readouterr().err.replace("'", "")
    assert cli_main(["finetune-long", str(base_run / "base"), "--target-len", "256", "--scaling", "dynamic",
                     *common]) == 2
    # Its fine-tuning takes the trainer's keys; context parallelism needs torchrun.
    assert cli_main(["finetune-long", str(base_run / "base"), "--target-len", "256", *common,
                     "parallel.context_parallel=2"]) == 2
    assert "parallel.context_parallel=2 needs torchrun with a multiple of 2 processes, got 1" in capsys.readouterr().err
    assert not out_dir.exists()


def test_context_parallel_fine_tuning_under_torchrun_matches_one_process(base_run, tmp_path):
    """Two torchrun ranks share every packed 128-token row (ring attention); rank 0 evaluates and reports.
    Losses, gradient norms and the fine-tuned model's perplexities equal one process's run."""
    from test_distributed import assert_same_losses, launch

    def args(out_dir, *overrides):
        return ["finetune-long", str(base_run / "base"), "--target-len", "128", "--steps", "2", "--eval-windows", "1",
                "--passkey-trials", "1", "--eval-lengths", "128", "--out-dir", str(out_dir), "batch_size=4",
                "micro_batch_size=2", "eval_every=2", "ckpt_every=2", *overrides]

    one = tmp_path / "one"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(args(one)) == 0
    cp = tmp_path / "cp"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
               "-m", "flashformer.cli", *args(cp, "parallel.context_parallel=2")]
    result = launch(command, True)
    assert "(1 data- x 2 context-parallel)" in result.stdout
    assert result.stdout.count("report: ") == 1  # rank 0's
    assert_same_losses(cp, one)
    reports = [json.loads((run / REPORT_FILE).read_text()) for run in (cp, one)]
    assert reports[0]["steps"] == 2
    for model in MODELS:
        assert reports[0]["lengths"][0][f"ppl_{model}"] == pytest.approx(reports[1]["lengths"][0][f"ppl_{model}"],
                                                                         rel=1e-5), model


def test_passkey_examples_join_training_only_and_fit_the_original_context(tmp_path):
    documents = tmp_path / "docs"
    documents.mkdir()
    rng = np.random.default_rng(0)
    for index in range(40):
        words = rng.choice(["alpha", "beta", "gamma", "delta"], size=200)
        (documents / f"doc{index:02d}.txt").write_text(" ".join(words))
    base = DataConfig(source="files", train_files=[str(documents / "*.txt")], cache_dir=str(tmp_path / "cache"))
    tokenizer = ByteTokenizer()
    mixed = mix_in_passkey_documents(base, tokenizer, 0.2, 128, str(tmp_path / "passkeys"), seed=0)
    base_train, base_eval = load_corpus(base, tokenizer)
    mixed_train, mixed_eval = load_corpus(mixed, tokenizer)

    def documents_of(corpus):
        return [tuple(corpus.tokens[a:b].tolist()) for a, b in zip(corpus.doc_starts[:-1], corpus.doc_starts[1:])]

    assert not set(documents_of(base_eval)) & set(documents_of(mixed_train))  # held out stays held out
    passkey_docs = [d for d in documents_of(mixed_train) if b"pass key" in bytes(d[:-1])]
    assert passkey_docs and all(len(d) <= 128 + 1 for d in passkey_docs)  # + the EOS token
    share = sum(map(len, passkey_docs)) / mixed_train.num_tokens
    assert 0.15 < share < 0.25
    with pytest.raises(DataError, match="split by its tail"):
        single = tmp_path / "single.txt"
        single.write_text("one long document " * 500)
        mix_in_passkey_documents(DataConfig(source="files", train_files=[str(single)],
                                            cache_dir=str(tmp_path / "cache")),
                                 tokenizer, 0.2, 128, str(tmp_path / "passkeys2"), seed=0)


def test_the_script_is_the_command():
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "finetune_long.py")
    result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--target-len" in result.stdout
