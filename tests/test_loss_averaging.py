"""The step's gradient is that of the mean loss over all its targets: micro batches and data-parallel ranks
holding few targets (chat data's prompts are ignored) weigh by their targets, not as much as full ones."""

import copy
import os

import pytest
import torch
import yaml

from flashformer.batches import IGNORE_INDEX, Batch
from flashformer.model import ModelConfig, Transformer
from flashformer.train import load_train_config, train
from flashformer.train.step import train_step
from test_distributed import CPU, assert_same_losses, torchrun
from test_train import one_thread  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelConfig(family="llama", vocab_size=64, d_model=32, n_layer=2, n_head=2, n_kv_head=1, d_ff=64,
                   max_seq_len=32)


def rows_with_uneven_targets():
    """Four rows of 16 tokens whose targets are ignored in very different numbers: 15, 0, 12 and 9."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, TINY.vocab_size, (4, 16), generator=generator)
    targets = torch.randint(0, TINY.vocab_size, (4, 16), generator=generator)
    targets[0, 1:] = IGNORE_INDEX
    targets[2, :12] = IGNORE_INDEX
    targets[3, ::2] = IGNORE_INDEX
    targets[3, 1] = IGNORE_INDEX
    return input_ids, targets


def sgd_update(model, micro_batches, **step_options):
    """(the step's loss, -gradient of every parameter): one SGD step of lr 1 moves each by its gradient."""
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss, _ = train_step(model, optimizer, micro_batches, **step_options)
    return loss, [p.detach() - b for p, b in zip(model.parameters(), before)]


@pytest.mark.parametrize("loss_chunk_size", [None, 8])
def test_accumulated_micro_batches_give_the_gradient_of_one_batch_of_their_rows(loss_chunk_size):
    torch.manual_seed(0)
    model = Transformer(TINY)
    input_ids, targets = rows_with_uneven_targets()
    whole = [Batch(input_ids, targets)]
    # Micro batches of 1, 2 and 1 rows holding 1, 4 + 7 and 8 targets.
    micro = [Batch(input_ids[rows], targets[rows]) for rows in (slice(0, 1), slice(1, 3), slice(3, 4))]
    expected_loss, expected = sgd_update(model, whole, loss_chunk_size=loss_chunk_size)
    loss, updates = sgd_update(model, micro, loss_chunk_size=loss_chunk_size)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    assert max(e.abs().max() for e in expected) > 1e-3  # a gradient large enough for the tolerance to tell
    for ours, reference in zip(updates, expected):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_a_micro_batch_without_targets_adds_nothing():
    torch.manual_seed(0)
    model = Transformer(TINY)
    input_ids, targets = rows_with_uneven_targets()
    no_targets = torch.full_like(targets[:1], IGNORE_INDEX)
    expected_loss, expected = sgd_update(model, [Batch(input_ids[1:], targets[1:])])
    loss, updates = sgd_update(model, [Batch(input_ids[:1], no_targets), Batch(input_ids[1:], targets[1:])])
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for ours, reference in zip(updates, expected):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def sft_recipe(out_dir, cache_dir, **fields) -> dict:
    """configs/sft-tiny.yaml for a few steps: the loss is on the assistant's tokens only, a few dozen a row."""
    with open(os.path.join(ROOT, "configs", "sft-tiny.yaml")) as f:
        recipe = yaml.safe_load(f)
    directory = os.path.join(ROOT, "configs", "sft-tiny")
    recipe.update(out_dir=str(out_dir), steps=4, log_every=1, eval_every=2, ckpt_every=4, batch_size=4,
                  sample={"max_new_tokens": 0}, **CPU, **fields)
    # eval_fraction 0.2: 4 held-out rows, which 1 and 2 ranks both evaluate whole.
    recipe["data"].update(cache_dir=str(cache_dir), tokenizer=directory, eval_fraction=0.2,
                          train_files=[os.path.join(directory, "conversations.jsonl")])
    return recipe


def test_two_ddp_ranks_accumulating_chat_rows_match_one_process(tmp_path):
    # One process: the step's 4 rows in one micro batch. Two ranks: one row per micro batch, two each; the
    # rows hold different numbers of assistant tokens. Evaluation too: rows in one batch, or one by one.
    cache = tmp_path / "cache"
    train(load_train_config(sft_recipe(tmp_path / "one", cache, micro_batch_size=4)))
    torchrun(sft_recipe(tmp_path / "two", cache, micro_batch_size=1, parallel={"mode": "ddp"}), tmp_path)
    assert_same_losses(tmp_path / "two", tmp_path / "one")
