"""Corpus loading, the token cache and training batches (flashformer.data)."""

import json
import os

import numpy as np
import pytest
import torch

from flashformer.batches import IGNORE_INDEX, TrainBatches, eval_batches
from flashformer.data import (
    DataConfig,
    DataError,
    TokenCorpus,
    corpus_cache_dir,
    load_corpus,
    stdlib_source_files,
)
from flashformer.tokenizer import ByteTokenizer

EOS = ByteTokenizer().eos_id


class CountingTokenizer(ByteTokenizer):
    """A byte tokenizer that counts its encode calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


class ForbiddenTokenizer(ByteTokenizer):
    def encode(self, text):
        raise AssertionError("the cached corpus was tokenized again")


def write_text_files(directory, count=24):
    paths = []
    for i in range(count):
        path = directory / f"doc{i:02d}.txt"
        path.write_text(f"document {i}\n" + "word " * (20 + i))
        paths.append(path)
    return paths


def files_config(tmp_path, **fields):
    write_text_files(tmp_path)
    return DataConfig(source="files", train_files=[str(tmp_path / "doc*.txt")], cache_dir=str(tmp_path / "cache"),
                      seq_len=16, **fields)


def test_second_load_reads_the_cache_without_tokenizing(tmp_path):
    cfg = files_config(tmp_path)
    counting = CountingTokenizer()
    train, held_out = load_corpus(cfg, counting)
    assert counting.calls == 24
    train_again, held_out_again = load_corpus(cfg, ForbiddenTokenizer())
    np.testing.assert_array_equal(train.tokens, train_again.tokens)
    np.testing.assert_array_equal(held_out.doc_starts, held_out_again.doc_starts)


@pytest.mark.parametrize("damage", ["cut", "changed", "empty", "meta"])
def test_a_damaged_cache_is_refused_naming_the_file(tmp_path, damage):
    """A token cache cut short, changed, emptied or with an unreadable meta.json must not train on: the
    error names the file and says how to rebuild."""
    cfg = files_config(tmp_path)
    load_corpus(cfg, ByteTokenizer())
    cache_dir = corpus_cache_dir(cfg)
    path = os.path.join(cache_dir, "train.bin")
    data = open(path, "rb").read()
    damaged = {"cut": data[:len(data) // 2], "changed": data[:100] + bytes([data[100] ^ 1]) + data[101:],
               "empty": b""}.get(damage)
    if damaged is None:
        with open(os.path.join(cache_dir, "meta.json"), "w") as f:
            f.write("{not json")
    else:
        with open(path, "wb") as f:
            f.write(damaged)
    expected = {"cut": "train.bin holds", "changed": "checksum mismatch", "empty": "train.bin holds",
                "meta": "unreadable"}[damage]
    with pytest.raises(DataError, match=expected) as error:
        load_corpus(cfg, ForbiddenTokenizer())
    assert "to rebuild it" in str(error.value)


def test_cache_key_changes_with_sources_and_tokenizer(tmp_path):
    cfg = files_config(tmp_path)
    key = corpus_cache_dir(cfg)
    (tmp_path / "doc03.txt").write_text("changed and longer than before")
    assert corpus_cache_dir(cfg) != key
    tokenizer_file = tmp_path / "tokenizer.json"
    tokenizer_file.write_text("{}")
    assert corpus_cache_dir(DataConfig(**{**cfg.__dict__, "tokenizer": str(tokenizer_file)})) != corpus_cache_dir(cfg)


def test_documents_end_with_eos_and_every_twentieth_is_held_out(tmp_path):
    cfg = files_config(tmp_path)
    train, held_out = load_corpus(cfg, ByteTokenizer())
    assert (train.num_docs, held_out.num_docs) == (23, 1)  # eval_fraction 0.05: every 20th document
    for corpus in (train, held_out):
        assert corpus.tokens.dtype == np.uint16
        assert corpus.doc_starts[-1] == corpus.num_tokens
        assert (corpus.tokens[corpus.doc_starts[1:] - 1] == EOS).all()
        assert (corpus.tokens[corpus.doc_starts[1:] - 1 - 1] != EOS).all()
    assert ByteTokenizer().decode(held_out.tokens[:-1]) == (tmp_path / "doc19.txt").read_text()


def test_one_big_document_splits_its_tail_off_for_eval(tmp_path):
    (tmp_path / "all.txt").write_text("abcdefghij" * 100)
    cfg = DataConfig(source="files", train_files=[str(tmp_path / "all.txt")], cache_dir=str(tmp_path / "c"), seq_len=8)
    train, held_out = load_corpus(cfg, ByteTokenizer())
    assert train.num_tokens + held_out.num_tokens == 1001
    assert held_out.num_tokens == 50


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_jsonl_and_parquet_read_the_text_field(tmp_path, kind):
    rows = [{"body": f"row {i} " * 5, "id": i} for i in range(40)]
    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = DataConfig(source="files", train_files=[str(path)], text_field="body", cache_dir=str(tmp_path / "c"))
    train, held_out = load_corpus(cfg, ByteTokenizer())
    assert (train.num_docs, held_out.num_docs) == (38, 2)
    assert ByteTokenizer().decode(train.tokens[: train.doc_starts[1] - 1]) == rows[0]["body"]
    wrong_field = DataConfig(**{**cfg.__dict__, "text_field": "text", "cache_dir": str(tmp_path / "c2")})
    with pytest.raises(DataError, match="text_field='text' is not a column"):
        load_corpus(wrong_field, ByteTokenizer())


def test_missing_files_and_bad_values_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        corpus_cache_dir(DataConfig(source="files", train_files=[str(tmp_path / "nope/*.txt")]))
    with pytest.raises(DataError, match="needs data.train_files"):
        DataConfig(source="files").validate()
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="must all be one kind"):
        corpus_cache_dir(DataConfig(source="files", train_files=[str(tmp_path / "x.csv")]))


def test_stdlib_corpus_is_a_fixed_subset_with_held_out_files(tmp_path):
    files = stdlib_source_files(1_000_000)
    assert files == stdlib_source_files(1_000_000)
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    cfg = DataConfig(stdlib_max_bytes=1_000_000, cache_dir=str(tmp_path))
    train, held_out = load_corpus(cfg, ByteTokenizer())
    assert train.num_docs + held_out.num_docs == len(files)
    assert held_out.num_docs == len(files) // 20
    assert "def " in ByteTokenizer().decode(train.tokens[:100_000])


def corpus_of(doc_lengths):
    """A corpus whose document i is doc_lengths[i] tokens of value i (the last one an EOS)."""
    docs = [np.array([i] * (n - 1) + [EOS], dtype=np.uint16) for i, n in enumerate(doc_lengths)]
    return TokenCorpus(np.concatenate(docs), np.cumsum([0] + list(doc_lengths)))


def test_packed_rows_restart_positions_and_segments_at_documents():
    corpus = corpus_of([5, 3, 12, 4])  # document starts at 0, 5, 8, 20; 24 tokens
    cfg = DataConfig(seq_len=6, packing="packed")
    batch = eval_batches(corpus, cfg, num_rows=3, micro_batch=3)[0]  # rows start at 0, 6, 12
    assert batch.input_ids.tolist() == [[0, 0, 0, 0, EOS, 1], [1, EOS, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2]]
    assert batch.targets[0].tolist() == [0, 0, 0, EOS, 1, 1]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 5, 6, 8, 12, 18]
    assert batch.max_seqlen == 6
    blocks = eval_batches(corpus, DataConfig(seq_len=6), num_rows=3, micro_batch=3)[0]
    assert blocks.cu_seqlens is None and blocks.position_ids is None
    assert torch.equal(blocks.input_ids, batch.input_ids)


def test_sampler_resumes_from_its_position_and_ranks_split_the_global_batch():
    corpus = TokenCorpus(np.arange(1000, dtype=np.uint16), np.array([0, 1000]))
    cfg = DataConfig(seq_len=10)
    whole = TrainBatches(corpus, cfg, global_batch=8, micro_batch=2, seed=3)
    steps = [whole.next_step() for _ in range(30)]  # 240 rows: more than the 99 windows, so 3 epochs
    assert whole.position == 240
    resumed = TrainBatches(corpus, cfg, global_batch=8, micro_batch=2, seed=3, position=8 * 17)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(steps[17], resumed.next_step()))
    rows_of_step = [torch.cat([b.input_ids for b in step]) for step in steps]
    for step_rows in rows_of_step:
        assert torch.equal(step_rows[:, 1:], step_rows[:, :-1] + 1)  # contiguous windows
    epoch = torch.cat(rows_of_step)[:99, 0]
    assert sorted(epoch.tolist()) == list(range(0, 990, 10))  # every window once per epoch
    ranks = [TrainBatches(corpus, cfg, global_batch=8, micro_batch=2, seed=3, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].grad_accum_steps == 2
    per_rank = [r.next_step() for r in ranks]
    interleaved = [per_rank[rank][micro].input_ids for micro in range(2) for rank in range(2)]
    assert torch.equal(torch.cat(interleaved), rows_of_step[0])
    with pytest.raises(DataError, match="not a multiple"):
        TrainBatches(corpus, cfg, global_batch=8, micro_batch=3, seed=0)


def test_eval_rows_are_shared_evenly_between_ranks():
    corpus = TokenCorpus(np.arange(100, dtype=np.uint16), np.array([0, 100]))
    cfg = DataConfig(seq_len=10)  # 9 windows
    single = torch.cat([b.input_ids for b in eval_batches(corpus, cfg, num_rows=40, micro_batch=4)])
    assert single.shape[0] == 9
    for world_size in (2, 3, 4):
        shares = [eval_batches(corpus, cfg, num_rows=40, micro_batch=4, rank=r, world_size=world_size)
                  for r in range(world_size)]
        # the same forwards on every rank, and together the one-rank set: every row once, each of its targets
        assert len({tuple(b.input_ids.shape[0] for b in share) for share in shares}) == 1
        rows = [(b.input_ids[i], b.targets[i]) for share in shares for b in share for i in range(b.input_ids.shape[0])]
        scored = sorted((int(ids[0]), targets.tolist()) for ids, targets in rows if (targets != IGNORE_INDEX).any())
        assert [start for start, _ in scored] == list(range(0, 90, 10))
        single_targets = torch.cat([b.targets for b in eval_batches(corpus, cfg, num_rows=40, micro_batch=4)])
        assert [targets for _, targets in scored] == single_targets.tolist()
        fillers = [targets for _, targets in rows if (targets == IGNORE_INDEX).all()]
        assert len(fillers) == len(rows) - 9
