"""Hub ids ("org/name") load from the Hugging Face cache: from_pretrained, revisions, init_from, and the
error offline. The cache is built here in huggingface_hub's layout; every process runs with
HF_HUB_OFFLINE=1, so nothing is downloaded."""

import json
import os
import subprocess
import sys

import pytest
import torch

from flashformer.model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-llama"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}
CONFIG = ModelConfig(family="llama", vocab_size=257, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64,
                     max_seq_len=64)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """HF_HUB_CACHE holding REPO at two revisions (main and the tag v1), as the hub's cache lays them out:
    refs/<revision> names a commit, snapshots/<commit>/ holds its files. Returns (cache, {revision: model})."""
    cache = tmp_path_factory.mktemp("hub")
    repo_dir = cache / f"models--{REPO.replace('/', '--')}"
    models = {}
    for seed, (revision, commit) in enumerate(COMMITS.items()):
        torch.manual_seed(seed)
        models[revision] = Transformer(CONFIG)
        models[revision].save_pretrained(repo_dir / "snapshots" / commit, format="hf")
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / revision).write_text(commit)
    return cache, models


# One offline process does what the tests below check: from_pretrained at two revisions, then three commands
# through the command line's entry point, each with its exit code and output. A process apiece would cost
# seconds of start-up each; the variables must be set before huggingface_hub is imported.
CHILD = """
import contextlib, io, json, sys
import torch
import flashformer
from flashformer.cli import main

loaded, commands = sys.argv[1], json.loads(sys.argv[2])
torch.save({r: flashformer.from_pretrained(%r, revision=r).state_dict() for r in (None, "v1")}, loaded)
done = {}
for name, argv in commands.items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    done[name] = {"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
print(json.dumps(done))
""" % REPO


@pytest.fixture(scope="module")
def offline(hub_cache, tmp_path_factory):
    """{"loaded": from_pretrained's state dicts by revision, "run": the train command's run directory, and each
    command's {"returncode", "stdout", "stderr"} by name}."""
    cache, _ = hub_cache
    directory = tmp_path_factory.mktemp("offline")
    run = directory / "run"
    commands = {
        "missing": ["generate", "tiny-org/not-there", "--device", "cpu"],
        "generate": ["generate", REPO, "--revision", "v1", "--prompt", "ab", "--max-new-tokens", "3", "--device", "cpu"],
        "train": ["train", "configs/tiny.yaml", f"init_from={REPO}", "init_revision=v1", "steps=1", "batch_size=2",
                  "micro_batch_size=2", "eval_batches=1", "data.source=files", "data.train_files=[README.md]",
                  "data.seq_len=32", f"data.cache_dir={directory / 'data'}", f"out_dir={run}",
                  "sample.max_new_tokens=0", "optim.lr=1e-30", "optim.min_lr=1e-30", "optim.weight_decay=0"],
    }
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(directory / "loaded.pt"), json.dumps(commands)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return {"loaded": torch.load(directory / "loaded.pt"), "run": run, **json.loads(child.stdout.splitlines()[-1])}


def test_from_pretrained_takes_a_hub_id_and_its_revision(hub_cache, offline):
    _, models = hub_cache
    loaded = offline["loaded"]
    for revision, name in ((None, "main"), ("v1", "v1")):
        expected = models[name].state_dict()
        assert loaded[revision].keys() == expected.keys()
        assert all(torch.equal(loaded[revision][key], expected[key]) for key in expected)
    assert not torch.equal(loaded[None]["embed.weight"], loaded["v1"]["embed.weight"])


def test_a_hub_id_missing_offline_names_it_and_what_to_do(offline):
    done = offline["missing"]
    assert done["returncode"] == 2 and "Traceback" not in done["stderr"]
    assert "tiny-org/not-there is neither a local directory nor in the Hugging Face cache" in done["stderr"]
    assert "HF_HUB_OFFLINE=1" in done["stderr"] and "hf download tiny-org/not-there" in done["stderr"]


def test_generate_from_a_hub_id_at_a_revision(hub_cache, offline):
    cache, _ = hub_cache
    done = offline["generate"]
    assert done["returncode"] == 0, done["stderr"][-2000:]
    snapshot = os.path.join(str(cache), f"models--{REPO.replace('/', '--')}", "snapshots", COMMITS["v1"])
    assert f"{snapshot} (the Hugging Face cache's snapshot of {REPO})" in done["stderr"]
    assert done["stdout"].startswith("ab")


def test_init_from_a_hub_id_at_a_revision(hub_cache, offline):
    _, models = hub_cache
    done = offline["train"]
    assert done["returncode"] == 0, done["stderr"][-2000:]
    from flashformer.checkpoint import from_pretrained

    trained = from_pretrained(offline["run"]).state_dict()
    expected = models["v1"].state_dict()
    # An lr of 1e-30 moves no fp32 weight of this size: the run holds v1's weights, not main's.
    assert all(torch.equal(trained[key], expected[key]) for key in expected)
    assert not torch.equal(trained["embed.weight"], models["main"].state_dict()["embed.weight"])
