"""``parallel.context_parallel``: real torchrun processes (gloo, CPU) whose ranks share each sequence
(ring attention) reproduce one process's run: losses, evaluations, tokens counted and final weights."""

import random

import pytest
import torch

from flashformer.checkpoint import from_pretrained
from flashformer.config import ConfigError
from flashformer.train import Trainer, load_train_config, read_metrics, train
from flashformer.train.model_setup import build_model
from test_distributed import CPU, assert_same_losses, torchrun, torchrun_each
from test_train import data_cache, one_thread, tiny_recipe  # noqa: F401 (fixtures)
from train_runs_worker import rewind_args

# fp32 on both sides, but not bitwise: the ring merges each query's attention over K/V blocks through
# their log-sum-exp, the loss is summed per slice, and DDP averages the ranks' partial gradients, all in
# another order than one process's single softmax, mean and backward.
WEIGHT_TOLERANCE = 1e-5


def assert_same_run(run_dir, reference_dir, checkpoint="ckpt-6"):
    """The same losses, evaluations, gradient norms and token counts, and the same weights at ``checkpoint``."""
    assert_same_losses(run_dir, reference_dir)
    tokens = [[(r["step"], r["tokens"]) for r in read_metrics(run) if "tokens" in r]
              for run in (run_dir, reference_dir)]
    assert tokens[0] == tokens[1]  # each token counted once, not once per rank that holds a slice of it
    ours, reference = (from_pretrained(run / checkpoint).state_dict() for run in (run_dir, reference_dir))
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, atol=WEIGHT_TOLERANCE, rtol=WEIGHT_TOLERANCE, msg=name)


FIELDS = dict(steps=6, eval_every=3, ckpt_every=3, batch_size=8, micro_batch_size=4, **CPU)


def test_two_context_parallel_ranks_match_one_process_on_whole_and_packed_rows_and_resume_as_data_parallel(
        tmp_path, data_cache):
    """Two runs in one launch: the stdlib's rows, and short documents (one a line: 2 to 40 bytes, against chunks
    of 8 tokens) that cross chunk and rank boundaries in almost every row, where the ring keeps attention
    inside each as the one process's varlen kernel does. Then, in the same launch, the first run resumed as
    data parallel, and a run of more context-parallel ranks than the launch has (refused)."""
    one = tmp_path / "one"
    train(load_train_config(tiny_recipe(one, data_cache, **FIELDS)))
    words = random.Random(0)
    lines = ["".join(words.choice("abcdef ghij\t") for _ in range(words.randint(1, 39))) for _ in range(400)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    data = dict(data__source="files", data__train_files=[str(tmp_path / "lines.txt")], data__text_sample_by="line",
                data__packing="packed", data__cache_dir=str(tmp_path / "cache"))
    fields = {**FIELDS, "steps": 2, "eval_every": 2, "ckpt_every": 2}
    packed_one = tmp_path / "packed-one"
    train(load_train_config(tiny_recipe(packed_one, None, **data, **fields)))
    cp, packed_cp, resumed = tmp_path / "cp", tmp_path / "packed-cp", tmp_path / "cp-resumed"
    result = torchrun_each([
        tiny_recipe(cp, data_cache, parallel={"context_parallel": 2}, **FIELDS),
        tiny_recipe(packed_cp, None, parallel={"context_parallel": 2}, **data, **fields),
        # The checkpoint holds the whole model: the same run continues with another layout (here 2 data-parallel
        # ranks, each on whole rows), as if it had died after ckpt-3.
        rewind_args(cp, resumed, 3), ["--resume", str(resumed), "parallel.context_parallel=1"],
        # The refused run last: a failed run ends the launch.
        tiny_recipe(tmp_path / "cp4", data_cache, parallel={"context_parallel": 4}, data__seq_len=32),
    ], tmp_path, succeed=False)
    assert result.stdout.count("(1 data- x 2 context-parallel)") == 2  # rank 0's, once a run
    assert_same_run(cp, one)
    assert_same_run(packed_cp, packed_one, "ckpt-2")
    assert_same_run(resumed, one)
    assert "parallel.context_parallel=4 needs torchrun with a multiple of 4 processes, got 2" in result.stderr


def test_two_data_by_two_context_parallel_ranks_under_fsdp_match_one_process(tmp_path, data_cache):
    # chunked_loss: the slices' summed loss comes out of the sharded root module's forward. Activation
    # checkpointing recomputes the ring's forward in backward.
    fields = {**FIELDS, "micro_batch_size": 2, "chunked_loss": True}
    one = tmp_path / "one"
    train(load_train_config(tiny_recipe(one, data_cache, **fields)))
    mesh = tmp_path / "mesh"
    torchrun(tiny_recipe(mesh, data_cache, parallel={"mode": "fsdp", "context_parallel": 2},
                         activation_checkpointing=True, **fields), tmp_path, processes=4)
    assert_same_run(mesh, one)


@pytest.mark.parametrize("fields, message", [
    (dict(data__seq_len=30), r"data.seq_len=30 must be divisible by 4"),
    (dict(attn_backend="sdpa"), r"attn_backend='sdpa'"),
    (dict(parallel={"context_parallel": 0}), r"parallel.context_parallel must be >= 1"),
])
def test_context_parallel_refuses_what_the_ring_cannot_do(tmp_path, data_cache, fields, message):
    recipe = tiny_recipe(tmp_path, data_cache, **{"parallel": {"context_parallel": 2}, **fields})
    with pytest.raises(ConfigError, match=message):
        load_train_config(recipe)


def test_context_parallel_needs_torchrun_with_a_multiple_of_its_ranks(tmp_path, data_cache):
    cfg = load_train_config(tiny_recipe(tmp_path / "alone", data_cache, parallel={"context_parallel": 2}))
    with pytest.raises(ConfigError, match=r"parallel.context_parallel=2 needs torchrun .* got 1"):
        Trainer(cfg)
    # Its torchrun half (two ranks where four are needed) runs last in the first test's launch.


def test_context_parallel_refuses_softcaps(tmp_path, data_cache):
    recipe = tiny_recipe(tmp_path, data_cache, parallel={"context_parallel": 2})
    recipe["model"].update(family="custom", attn_softcap=30.0)
    cfg = load_train_config(recipe)
    with pytest.raises(ConfigError, match=r"model.attn_softcap=30.0"):
        build_model(cfg, torch.device("cpu"), bf16=False, init_dir=None, weights_from=None, resume_from=None)
