"""Tokenizers: raw UTF-8 bytes, or a BPE ``tokenizer.json`` through the ``tokenizers`` package.

A checkpoint directory with a tokenizer.json uses it; without one it is byte-level (ids 0..255
are bytes, special tokens follow from 256).

Next to a tokenizer.json, a Hugging Face checkpoint keeps what transformers adds on top:
tokenizer_config.json (bos / eos / pad tokens, add_bos_token / add_eos_token, chat_template),
chat_template.jinja and generation_config.json (the eos_token_id list generation stops at). HFTokenizer reads both and
encodes as ``AutoTokenizer(text)["input_ids"]`` does.
"""

from __future__ import annotations

import os
import shutil

from .weights import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers hands a chat template as variables (its special_tokens_map).
_TEMPLATE_TOKEN_ROLES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
ENDOFTEXT = "<|endoftext|>"
# End-of-sequence spellings for a bare tokenizer.json (no tokenizer_config.json naming its eos_token),
# e.g. one written by train_bpe, in order of preference.
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

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation."""
        return () if self.eos_id is None else (self.eos_id,)

    bos_id = None
    pad_id = None

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes of ``text``; special-token strings inside it are encoded as plain bytes (and none is added)."""
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


def _read_json(path) -> dict:
    """An optional JSON side file of a tokenizer: {} when absent, CheckpointError naming it when malformed."""
    return read_json(path) if os.path.isfile(path) else {}


def _token_text(token) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(config: dict, jinja_path: str) -> str | None:
    """The chat template transformers would use: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of {"name", "template"} of which "default" is the one)."""
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template


class HFTokenizer:
    """A ``tokenizers`` tokenizer.json (BPE or any other model), with the special tokens that
    transformers applies from the tokenizer_config.json / generation_config.json beside it.

    Args:
        path: the tokenizer.json file.
    """

    def __init__(self, path):
        from tokenizers import AddedToken, Tokenizer, processors

        self.path = os.fspath(path)
        self._tokenizer = Tokenizer.from_file(self.path)
        directory = os.path.dirname(os.path.abspath(self.path))
        self._extra_files = [os.path.join(directory, name)
                             for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, GENERATION_CONFIG_FILE,
                                          CHAT_TEMPLATE_FILE)
                             if os.path.isfile(os.path.join(directory, name))]
        config = {**_read_json(os.path.join(directory, SPECIAL_TOKENS_FILE)),
                  **_read_json(os.path.join(directory, TOKENIZER_CONFIG_FILE))}
        self._generation = _read_json(os.path.join(directory, GENERATION_CONFIG_FILE))
        self._chat_template = _chat_template(config, os.path.join(directory, CHAT_TEMPLATE_FILE))
        self._special = {role: _token_text(config.get(f"{role}_token")) for role in _TEMPLATE_TOKEN_ROLES}
        # transformers adds named special tokens missing from the vocabulary.
        missing = [self._special[role] for role in ("bos", "eos", "pad")
                   if self._special[role] is not None and self._tokenizer.token_to_id(self._special[role]) is None]
        if missing:
            self._tokenizer.add_special_tokens([AddedToken(t, special=True) for t in missing])
        # An explicit add_bos_token / add_eos_token replaces tokenizer.json's post-processor with
        # [bos] $A [eos] (transformers' update_post_processor); without either, tokenizer.json's own
        # post-processor (e.g. Llama 3's TemplateProcessing) decides.
        if "add_bos_token" in config or "add_eos_token" in config:
            bos, eos = ([self._special[role]] if config.get(f"add_{role}_token") and self._special[role] else []
                        for role in ("bos", "eos"))
            single = " ".join([f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos])
            pair = f"{single} " + " ".join([f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos])
            ids = {t: self._tokenizer.token_to_id(t) for t in bos + eos}
            self._tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                           special_tokens=list(ids.items()))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _special_id(self, role: str) -> int | None:
        token = self._special[role]
        if token is not None:
            return self._tokenizer.token_to_id(token)
        token_id = self._generation.get(f"{role}_token_id")
        return token_id[0] if isinstance(token_id, list) and token_id else token_id

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad")

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's eos_token (what ends a training document); for a bare tokenizer.json the
        first of the usual spellings it has."""
        token_id = self._special_id("eos")
        if token_id is not None or self._extra_files:
            return token_id
        for token in _EOS_CANDIDATES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: generation_config.json's eos_token_id (an int or a list,
        e.g. Llama 3 Instruct's end-of-turn tokens), else (eos_id,)."""
        eos = self._generation.get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
        return () if self.eos_id is None else (self.eos_id,)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the bos / eos tokens transformers would add (add_special_tokens)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` without added special tokens (as transformers tokenizes a rendered chat), and
        each token's (start, end) character offsets in ``text``."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @property
    def chat_template(self) -> str | None:
        """The jinja chat template: chat_template.jinja, else tokenizer_config.json's (its "default" one
        where it names several); None without one."""
        return self._chat_template

    @property
    def template_tokens(self) -> dict[str, str]:
        """The special tokens a chat template sees as variables: {"bos_token": "<s>", ...}."""
        return {f"{role}_token": token for role, token in self._special.items() if token is not None}

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory) -> None:
        """Write ``directory/tokenizer.json``, and copy the tokenizer_config.json, special_tokens_map.json
        and generation_config.json it was loaded with."""
        directory = os.fspath(directory)
        self._tokenizer.save(os.path.join(directory, TOKENIZER_FILE))
        for path in self._extra_files:
            target = os.path.join(directory, os.path.basename(path))
            if os.path.abspath(path) != os.path.abspath(target):
                shutil.copyfile(path, target)


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
