"""The command line's conventions: help and version on stdout, usage errors in one line with exit 2."""

import contextlib
import io
import shutil
import subprocess
import sys

import pytest
import torch

from flashformer.cli import main
from flashformer.model import ModelConfig, Transformer


def run(*args) -> subprocess.CompletedProcess:
    """The command's exit code and output, run in this process as ``python -m flashformer.cli`` runs it
    (``sys.exit(main())``): a process of its own would cost seconds of start-up per test. The first test
    checks that real process."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's usage errors and --help
            code = exit.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def test_help_lists_every_command_on_stdout():
    done = subprocess.run([sys.executable, "-m", "flashformer.cli", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stderr == ""
    for command in ("train", "generate", "tokenizer", "finetune-long"):
        assert f"  {command} " in done.stdout


def test_version_on_stdout():
    from flashformer import __version__

    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"flashformer {__version__}"


@pytest.mark.parametrize("args, message", [
    (["trian"], "unknown command 'trian' (did you mean 'train'?)"),
    (["xyzzy"], "unknown command 'xyzzy'; the commands are train"),
    ([], "a command is required"),
])
def test_usage_errors_exit_2_with_a_message(args, message):
    done = run(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    Transformer(ModelConfig(family="gpt2", vocab_size=256, d_model=32, n_layer=1, n_head=2,
                            max_seq_len=16)).save_pretrained(directory)
    return directory


def test_generate_options_have_help_and_defaults():
    done = run("generate", "--help")
    assert done.returncode == 0
    for option in ("--max-new-tokens", "--top-k", "--seed", "--device"):
        line = done.stdout[done.stdout.index(option):].split("\n  -")[0]
        assert len(line.split()) > 2, f"{option} has no help text: {line!r}"
    assert "default: 200" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-1"], "must be a positive integer"),
    (["--max-new-tokens", "100"], "exceeds max_seq_len=16"),
])
def test_generate_refuses_bad_lengths_in_one_line(gpt2_checkpoint, args, message):
    done = run("generate", str(gpt2_checkpoint), "--prompt", "ab", "--device", "cpu", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_generate_on_a_missing_checkpoint_is_one_line(tmp_path):
    done = run("generate", str(tmp_path / "nothing"), "--device", "cpu")
    assert done.returncode == 2 and "not found" in done.stderr and "Traceback" not in done.stderr


def test_generate_on_a_truncated_checkpoint_is_one_line_naming_the_file(tmp_path, gpt2_checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(gpt2_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    done = run("generate", str(broken), "--prompt", "ab", "--device", "cpu")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{weights.name} is corrupted or truncated" in done.stderr, done.stderr


def test_generate_past_the_configured_context_warns_for_rope(tmp_path):
    from flashformer.generate import generate

    torch.manual_seed(0)
    model = Transformer(ModelConfig(family="llama", vocab_size=64, d_model=32, n_layer=1, n_head=2, max_seq_len=8))
    for call in (lambda: generate(model, torch.tensor([[1, 2]]), 10, temperature=0.0),
                 lambda: model.generate(torch.tensor([[1, 2]]), max_new_tokens=10, temperature=0.0)):
        with pytest.warns(UserWarning, match="past the 8 this model was configured for") as caught:
            call()
        assert caught[0].filename == __file__  # the caller's line, not one inside flashformer or torch


def test_model_generate_refuses_past_learned_positions(gpt2_checkpoint):
    import flashformer

    model = flashformer.from_pretrained(gpt2_checkpoint)
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        model.generate(torch.tensor([[1, 2]]), max_new_tokens=15)


def test_generate_takes_a_run_directory_and_names_the_checkpoint_it_picked(tmp_path, gpt2_checkpoint):
    import shutil

    run_dir = tmp_path / "run"
    for step in (3, 12):
        shutil.copytree(gpt2_checkpoint, run_dir / f"ckpt-{step}")
    done = run("generate", str(run_dir), "--prompt", "ab", "--max-new-tokens", "3", "--device", "cpu", "--seed", "0")
    assert done.returncode == 0, done.stderr
    assert f"{run_dir / 'ckpt-12'} (the latest checkpoint of {run_dir})" in done.stderr
    assert done.stdout.startswith("ab")


def test_generate_refuses_a_vocabulary_without_its_tokenizer(tmp_path):
    torch.manual_seed(0)
    Transformer(ModelConfig(family="gpt2", vocab_size=1000, d_model=32, n_layer=1, n_head=2,
                            max_seq_len=16)).save_pretrained(tmp_path)
    done = run("generate", str(tmp_path), "--prompt", "ab", "--device", "cpu")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no tokenizer.json for its 1000-token vocabulary" in done.stderr
