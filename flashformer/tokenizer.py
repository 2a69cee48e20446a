"""Tokenizers: raw UTF-8 bytes, or a BPE ``tokenizer.json`` through the ``tokenizers`` package.

A checkpoint directory with a tokenizer.json uses it; without one it is byte-level (ids 0..255
are bytes, special tokens follow from 256).
"""

from __future__ import annotations

import os

TOKENIZER_FILE = "tokenizer.json"
ENDOFTEXT = "<|endoftext|>"
# End-of-sequence spellings of common tokenizer.json files, in order of preference.
_EOS_CANDIDATES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; special tokens get ids 256, 257, ...

    Args:
        special_tokens: their strings, in id order (default: <|endoftext|> = 256).
    """

    def __init__(self, special_tokens=(ENDOFTEXT,)):
        self.special_tokens = tuple(special_tokens)
        self._special_ids = {token: 256 + i for i, token in enumerate(self.special_tokens)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def eos_id(self) -> int | None:
        return self._special_ids.get(ENDOFTEXT)

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def encode(self, text: str) -> list[int]:
        """Bytes of ``text``; special-token strings inside it are encoded as plain bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        pieces, pending = [], bytearray()
        for token in (int(i) for i in ids):
            if 0 <= token < 256:
                pending.append(token)
            elif 256 <= token < self.vocab_size:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                pieces.append(self.special_tokens[token - 256])
            else:
                raise ValueError(f"token id {token} is outside the byte vocabulary of size {self.vocab_size}")
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def save(self, directory) -> None:
        """Nothing to write: a checkpoint without tokenizer.json loads as byte-level."""


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json (BPE or any other model).

    Args:
        path: the tokenizer.json file.
    """

    def __init__(self, path):
        from tokenizers import Tokenizer

        self.path = os.fspath(path)
        self._tokenizer = Tokenizer.from_file(self.path)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        for token in _EOS_CANDIDATES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory) -> None:
        """Write ``directory/tokenizer.json``."""
        self._tokenizer.save(os.path.join(os.fspath(directory), TOKENIZER_FILE))


def load_tokenizer(path_or_none=None):
    """The tokenizer of a checkpoint directory or a tokenizer.json file; byte-level when there is none.

    Args:
        path_or_none: a directory (its tokenizer.json if present), a .json file, or None.
    """
    if path_or_none is None:
        return ByteTokenizer()
    path = os.fspath(path_or_none)
    if os.path.isdir(path):
        candidate = os.path.join(path, TOKENIZER_FILE)
        return HFTokenizer(candidate) if os.path.isfile(candidate) else ByteTokenizer()
    if os.path.isfile(path):
        return HFTokenizer(path)
    raise ValueError(f"tokenizer path {path!r} is neither a directory nor a tokenizer.json file")


def train_bpe(files_or_iterator, vocab_size: int, out_path, special_tokens=(ENDOFTEXT,)) -> HFTokenizer:
    """Train a byte-level BPE tokenizer and write it (atomically) as a tokenizer.json.

    Args:
        files_or_iterator: a list of text-file paths (every item an existing file), or any iterable
            of strings (training text).
        vocab_size: final vocabulary size, at least 256 + len(special_tokens).
        out_path: destination tokenizer.json.
        special_tokens: added first, so <|endoftext|> gets id 0.
    Returns:
        The trained HFTokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .fileio import atomic_write_file

    if not isinstance(vocab_size, int) or vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be an int >= {256 + len(special_tokens)} (bytes + special tokens), "
                         f"got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if isinstance(files_or_iterator, (str, os.PathLike)):
        if not os.path.isfile(files_or_iterator):
            raise ValueError(f"files_or_iterator: {os.fspath(files_or_iterator)!r} is not a file")
        files_or_iterator = [files_or_iterator]
    if isinstance(files_or_iterator, (list, tuple)) and files_or_iterator and all(
            isinstance(f, (str, os.PathLike)) and os.path.isfile(f) for f in files_or_iterator):
        tokenizer.train([os.fspath(f) for f in files_or_iterator], trainer)
    else:
        tokenizer.train_from_iterator(files_or_iterator, trainer)
    text = tokenizer.to_str()
    atomic_write_file(out_path, lambda f: f.write(text.encode("utf-8")))
    return HFTokenizer(out_path)
