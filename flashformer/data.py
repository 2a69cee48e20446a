"""Text corpora -> a token cache on disk (batches.py cuts it into training batches).

    train, held_out = load_corpus(cfg.data, tokenizer)          # tokenizes once, then memmaps

Corpora come through ``datasets`` (local text / jsonl / parquet files, a hub dataset) or, by
default, from the Python standard library's own source files, which every machine already has.
Each corpus is tokenized once into a flat uint16/uint32 token file plus document offsets, with an
EOS token after each document, and cached under a key that hashes the sources, the tokenizer and
``DATA_CACHE_VERSION``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from .fileio import atomic_directory

# Bump when the cache layout or the tokenization rules change: old caches are then ignored.
DATA_CACHE_VERSION = 2

_BUILDER_BY_SUFFIX = {".txt": "text", ".py": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                      ".parquet": "parquet"}
# Stdlib files that are tables or generated data rather than code a person wrote.
_STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
_STDLIB_MAX_FILE_BYTES = 200_000


class DataError(ValueError):
    """A data source is missing, empty or unusable."""


def default_cache_dir() -> str:
    """Where token caches go unless ``data.cache_dir`` says otherwise: the user's cache directory
    ($XDG_CACHE_HOME, else ~/.cache) under flashformer/data, not the working directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flashformer", "data")


@dataclass
class DataConfig:
    """Where the text comes from, how it is tokenized and how it is cut into training rows.

    ``source``: ``stdlib`` (the Python standard library's sources, no download), ``files``
    (``train_files`` / ``eval_files``: paths or globs of .txt, .py, .md, .json(l) or .parquet) or
    ``hub`` (``hub_name``, downloaded by ``datasets``). Without explicit eval files or split, every
    ``round(1 / eval_fraction)``-th document is held out for evaluation.
    ``packing``: ``blocks`` cuts the token stream into rows of seq_len + 1 tokens; ``packed`` does
    the same but passes document boundaries (cu_seqlens, position_ids) so attention and positions
    restart at every document.
    ``format``: ``text`` (documents of text), or ``chat``: .jsonl files of {"messages": [...]} rendered
    with the tokenizer's chat template, the loss on assistant tokens only (chat.py; packed).
    """

    source: Literal["stdlib", "files", "hub"] = "stdlib"
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    hub_eval_split: str | None = None
    text_field: str = "text"
    text_sample_by: Literal["document", "paragraph", "line"] = "document"
    eval_fraction: float = 0.05
    stdlib_max_bytes: int = 4_000_000
    tokenizer: str | None = None
    seq_len: int = 256
    packing: Literal["blocks", "packed"] = "blocks"
    format: Literal["text", "chat"] = "text"
    cache_dir: str = field(default_factory=default_cache_dir)

    def validate(self) -> None:
        if self.seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {self.seq_len}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise DataError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.stdlib_max_bytes < 1:
            raise DataError(f"data.stdlib_max_bytes must be >= 1, got {self.stdlib_max_bytes}")
        if self.source == "files" and not self.train_files:
            raise DataError("data.source=files needs data.train_files (paths or globs)")
        if self.source == "hub" and not self.hub_name:
            raise DataError("data.source=hub needs data.hub_name")
        if self.format == "chat" and (self.source != "files" or self.packing != "packed"):
            raise DataError("data.format=chat needs data.source=files (.jsonl conversations) and data.packing=packed "
                            f"(got source={self.source}, packing={self.packing})")


@dataclass
class TokenCorpus:
    """A tokenized split: ``tokens`` (n_tokens,) uint16/uint32 memmap; ``doc_starts`` (n_docs + 1,) int64
    offsets of each document's first token, ending with n_tokens; ``loss_mask`` (n_tokens,) uint8, 1 where
    a token is a target with a loss (chat data; None: every token is); ``dropped``: documents left out
    for not fitting a row."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    loss_mask: np.ndarray | None = None
    dropped: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts.shape[0]) - 1


@dataclass
class _Sources:
    """Resolved inputs of one corpus: which ``datasets`` builder reads which files, or a hub dataset."""

    builder: str
    train_files: list[str]
    eval_files: list[str]
    builder_kwargs: dict

    def fingerprint(self) -> list:
        def stat(path):
            info = os.stat(path)
            return [os.path.abspath(path), info.st_size, info.st_mtime_ns]

        return [self.builder, sorted(self.builder_kwargs.items()), [stat(p) for p in self.train_files],
                [stat(p) for p in self.eval_files]]


def stdlib_source_files(max_bytes: int) -> list[str]:
    """A fixed subset of the standard library's ``*.py`` files, the default corpus.

    Files are ordered by a hash of their relative path (deterministic, yet spread over the whole
    library rather than alphabetical) and taken until ``max_bytes`` is reached. Test suites, the
    codec tables and generated data files are left out.
    """
    root = sysconfig.get_paths()["stdlib"]
    candidates = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-"))
        for name in files:
            path = os.path.join(directory, name)
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            if 0 < os.path.getsize(path) <= _STDLIB_MAX_FILE_BYTES:
                candidates.append(path)
    candidates.sort(key=lambda p: hashlib.sha1(os.path.relpath(p, root).encode()).hexdigest())
    chosen, total = [], 0
    for path in candidates:
        if total >= max_bytes:
            break
        chosen.append(path)
        total += os.path.getsize(path)
    return chosen


def _expand_paths(patterns: list[str], what: str) -> list[str]:
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise DataError(f"{what}: no file matches {pattern!r} (cwd: {os.getcwd()})")
        paths.extend(matches)
    return paths


def _resolve_sources(cfg: DataConfig) -> _Sources:
    if cfg.source == "stdlib":
        return _Sources("text", stdlib_source_files(cfg.stdlib_max_bytes), [], _text_options("document"))
    if cfg.source == "hub":
        kwargs = {"name": cfg.hub_config, "split": cfg.hub_split, "eval_split": cfg.hub_eval_split}
        return _Sources(cfg.hub_name, [], [], kwargs)
    train_files = _expand_paths(cfg.train_files, "data.train_files")
    eval_files = _expand_paths(cfg.eval_files, "data.eval_files")
    builders = {_BUILDER_BY_SUFFIX.get(os.path.splitext(p)[1].lower()) for p in train_files + eval_files}
    if None in builders or len(builders) != 1:
        names = sorted(os.path.basename(p) for p in train_files + eval_files)
        raise DataError(f"data files must all be one kind: text (.txt, .py, .md), json (.json, .jsonl) or parquet; "
                        f"got {names[:5]}")
    builder = builders.pop()
    return _Sources(builder, train_files, eval_files, _text_options(cfg.text_sample_by) if builder == "text" else {})


def _text_options(sample_by: str) -> dict:
    # A stray non-UTF-8 byte becomes U+FFFD rather than failing the whole corpus.
    return {"sample_by": sample_by, "encoding_errors": "replace"}


def tokenizer_fingerprint(tokenizer_path: str | None) -> str:
    """A hash naming the tokenizer: the bytes of its file(s), or ``byte`` for the byte-level default."""
    if tokenizer_path is None:
        return "byte"
    if os.path.isdir(tokenizer_path):
        paths = sorted(glob.glob(os.path.join(tokenizer_path, "tokenizer*")))
    else:
        paths = [tokenizer_path]
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def corpus_cache_dir(cfg: DataConfig, chat_template: str | None = None) -> str:
    """The cache directory of ``cfg``'s corpus: ``cfg.cache_dir/<hash of sources, tokenizer, version>``.

    Args:
        cfg: the data section of the training config.
        chat_template: for data.format=chat, the template's fingerprint (chat caches are laid out in
            rows of seq_len, so their key holds both).
    Raises:
        DataError: a data file is missing or of an unknown kind.
    """
    sources = _resolve_sources(cfg)
    key = {
        "version": DATA_CACHE_VERSION,
        "sources": sources.fingerprint(),
        "tokenizer": tokenizer_fingerprint(cfg.tokenizer),
        "text_field": cfg.text_field,
        "eval_fraction": cfg.eval_fraction,
    }
    if cfg.format == "chat":
        key["chat"] = {"template": chat_template, "seq_len": cfg.seq_len}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cfg.cache_dir, digest)


def load_corpus(cfg: DataConfig, tokenizer, build: bool = True) -> tuple[TokenCorpus, TokenCorpus]:
    """The (train, eval) token corpora of ``cfg``, tokenized on the first call and memmapped after.

    Args:
        cfg: the data section of the training config.
        tokenizer: has ``encode(str) -> list[int]``, ``eos_id`` and ``vocab_size``; only called
            when the cache does not exist yet.
        build: False on processes that must find the cache built by another one (other ranks).
    Raises:
        DataError: missing files, an unreachable hub dataset, or a corpus too small to split.
    """
    cache_dir = corpus_cache_dir(cfg)
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        if not build:
            raise DataError(f"token cache {cache_dir} is missing; the main process should have built it")
        _build_cache(cfg, _resolve_sources(cfg), tokenizer, cache_dir)
    return _open_split(cache_dir, "train"), _open_split(cache_dir, "eval")


def _open_split(cache_dir: str, split: str) -> TokenCorpus:
    """The split's memmapped tokens, after checking them against meta.json (sizes, offsets, checksum):
    a cut or changed cache must not train on silently, or let a resume diverge."""
    redo = f"delete {cache_dir} to rebuild it from the sources"
    try:
        with open(os.path.join(cache_dir, "meta.json")) as f:
            meta = json.load(f)
        dtype, expected = np.dtype(meta["dtype"]), meta["splits"][split]
        doc_starts = np.load(os.path.join(cache_dir, f"{split}_doc_starts.npy"), allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"token cache {cache_dir} is unreadable ({type(error).__name__}: {error}); {redo}") from None
    path = os.path.join(cache_dir, f"{split}.bin")
    size = os.path.getsize(path) if os.path.exists(path) else None
    if size != expected["tokens"] * dtype.itemsize:
        raise DataError(f"{path} holds {size} bytes where meta.json expects {expected['tokens']} tokens of "
                        f"{dtype.name}; {redo}")
    if len(doc_starts) != expected["documents"] + 1 or doc_starts[-1] != expected["tokens"]:
        raise DataError(f"{split}_doc_starts.npy in {cache_dir} does not match meta.json; {redo}")
    tokens = _checked_memmap(path, dtype, expected["blake2b"], redo)
    loss_mask = None
    if "loss_mask_blake2b" in expected:
        mask_path = os.path.join(cache_dir, f"{split}_loss_mask.bin")
        if not os.path.exists(mask_path) or os.path.getsize(mask_path) != expected["tokens"]:
            raise DataError(f"{mask_path} is missing or does not hold one byte per token; {redo}")
        loss_mask = _checked_memmap(mask_path, np.uint8, expected["loss_mask_blake2b"], redo)
    return TokenCorpus(tokens, doc_starts, loss_mask, expected.get("dropped", 0))


def _checked_memmap(path: str, dtype, blake2b: str, redo: str) -> np.ndarray:
    """``path`` memmapped as ``dtype``, after checking its checksum against meta.json's."""
    values = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype=dtype)
    digest = _token_digest()
    for start in range(0, len(values), 1 << 24):
        digest.update(np.ascontiguousarray(values[start:start + (1 << 24)]).tobytes())
    if digest.hexdigest() != blake2b:
        raise DataError(f"{path} changed since it was written (checksum mismatch); {redo}")
    return values


def _load_documents(cfg: DataConfig, sources: _Sources):
    """(train, eval or None) ``datasets.Dataset``s of the sources."""
    import datasets

    hf_cache = os.path.join(cfg.cache_dir, "hf")
    if sources.train_files:
        data_files = {"train": sources.train_files}
        if sources.eval_files:
            data_files["eval"] = sources.eval_files
        # Local files: datasets' "Downloading data" bars would only confuse; tokenizing shows its own.
        bars_were_on = not datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            loaded = datasets.load_dataset(sources.builder, data_files=data_files, cache_dir=hf_cache,
                                           **sources.builder_kwargs)
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
        return loaded["train"], loaded.get("eval")
    kwargs = sources.builder_kwargs
    try:
        train = datasets.load_dataset(sources.builder, kwargs["name"], split=kwargs["split"], cache_dir=hf_cache)
        held_out = None
        if kwargs["eval_split"]:
            held_out = datasets.load_dataset(sources.builder, kwargs["name"], split=kwargs["eval_split"],
                                             cache_dir=hf_cache)
    except Exception as error:  # offline, unknown name, gated: all surface as one clear message
        raise DataError(f"could not load hub dataset {sources.builder!r}: {error}") from error
    return train, held_out


def _texts(dataset, text_field: str):
    if text_field not in dataset.column_names:
        raise DataError(f"data.text_field={text_field!r} is not a column; columns: {dataset.column_names}")
    for rows in dataset.select_columns([text_field]).iter(batch_size=256):
        yield from rows[text_field]


def _token_digest():
    """The checksum of a split's token file (blake2b: fast enough to verify a cache at every start)."""
    return hashlib.blake2b(digest_size=16)


class _SplitWriter:
    """Appends documents (token ids + EOS) to ``<split>.bin`` and records their offsets and checksum;
    with ``loss_mask``, also each token's loss-mask byte to ``<split>_loss_mask.bin``."""

    def __init__(self, directory: str, split: str, dtype, loss_mask: bool = False):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.file = open(os.path.join(directory, f"{split}.bin"), "wb")
        self.mask_file = open(os.path.join(directory, f"{split}_loss_mask.bin"), "wb") if loss_mask else None
        self.doc_starts = [0]
        self.digest, self.mask_digest = _token_digest(), _token_digest()

    def add(self, ids: np.ndarray, loss_mask: np.ndarray | None = None) -> None:
        data = ids.astype(self.dtype).tobytes()
        self.file.write(data)
        self.digest.update(data)
        if self.mask_file is not None:
            mask = loss_mask.astype(np.uint8).tobytes()
            self.mask_file.write(mask)
            self.mask_digest.update(mask)
        self.doc_starts.append(self.doc_starts[-1] + len(ids))

    def close_files(self) -> None:
        self.file.close()
        if self.mask_file is not None:
            self.mask_file.close()

    def close(self) -> dict:
        """Closes the files; returns the split's entry of meta.json."""
        self.close_files()
        doc_starts = np.asarray(self.doc_starts, dtype=np.int64)
        np.save(os.path.join(self.directory, f"{self.split}_doc_starts.npy"), doc_starts)
        entry = {"documents": len(self.doc_starts) - 1, "tokens": int(doc_starts[-1]),
                 "blake2b": self.digest.hexdigest()}
        if self.mask_file is not None:
            entry["loss_mask_blake2b"] = self.mask_digest.hexdigest()
        return entry


def _build_cache(cfg: DataConfig, sources: _Sources, tokenizer, cache_dir: str) -> None:
    train_docs, eval_docs = _load_documents(cfg, sources)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eval_every = max(2, round(1 / cfg.eval_fraction))
    # Too few documents to hold whole ones out (e.g. one big .txt file): split the stream's tail instead.
    split_tail = eval_docs is None and len(train_docs) < eval_every

    def encode(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text) + [tokenizer.eos_id], dtype=np.int64)

    with atomic_directory(cache_dir, keep_existing=True) as tmp:
        writers = {split: _SplitWriter(tmp, split, dtype) for split in ("train", "eval")}
        try:
            if split_tail:
                stream = np.concatenate([encode(t) for t in _texts(train_docs, cfg.text_field) if t.strip()])
                n_eval = max(1, int(len(stream) * cfg.eval_fraction))
                writers["train"].add(stream[:-n_eval])
                writers["eval"].add(stream[-n_eval:])
            else:
                splits = [(train_docs, None)] + ([(eval_docs, "eval")] if eval_docs is not None else [])
                for dataset, fixed_split in splits:
                    texts = tqdm(_texts(dataset, cfg.text_field), total=len(dataset), unit="doc",
                                 desc=f"tokenizing {fixed_split or 'corpus'}")
                    for index, text in enumerate(texts):
                        if not text.strip():
                            continue
                        split = fixed_split or ("eval" if index % eval_every == eval_every - 1 else "train")
                        writers[split].add(encode(text))
        except BaseException:
            for writer in writers.values():  # atomic_directory discards the files: close them first
                writer.close_files()
            raise
        write_meta(tmp, writers, tokenizer.eos_id)


def write_meta(directory: str, writers: dict, eos_id: int | None, **extra_by_split: dict) -> None:
    """Close the split writers and write meta.json, refusing a split without documents.

    Args:
        directory: the cache directory being built.
        writers: {"train": _SplitWriter, "eval": _SplitWriter}.
        eos_id: the tokenizer's EOS id, recorded.
        extra_by_split: more entries per split, e.g. dropped={"train": 3, "eval": 0}.
    """
    splits = {split: writer.close() for split, writer in writers.items()}
    for name, values in extra_by_split.items():
        for split, value in values.items():
            splits[split][name] = value
    if splits["train"]["documents"] == 0 or splits["eval"]["documents"] == 0:
        raise DataError(f"the corpus yields {splits['train']['documents']} training and "
                        f"{splits['eval']['documents']} eval documents; both must be > 0")
    dtype = writers["train"].dtype
    meta = {"version": DATA_CACHE_VERSION, "dtype": np.dtype(dtype).name, "splits": splits, "eos_id": eos_id}
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f)
