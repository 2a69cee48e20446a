"""Chat conversations -> token ids whose loss falls on the assistant's tokens only (supervised fine-tuning).

    template = ChatTemplate.of(tokenizer)
    ids, loss_mask = encode_conversation(tokenizer, template, messages)
    train, held_out = load_chat_corpus(cfg.data, tokenizer)     # data.format: chat

A conversation is rendered with the tokenizer's jinja ``chat_template`` as transformers'
``apply_chat_template`` renders it, then tokenized without added special tokens (the template writes
them). The assistant's spans are the template's ``{% generation %}`` blocks where it has them (as in
transformers' ``return_assistant_tokens_mask``), otherwise, for each assistant message, the text between
the conversation before it rendered with the generation prompt and the conversation through it. A token
carries loss where it overlaps a span.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
from datetime import datetime

import numpy as np

from .data import DataConfig, DataError, TokenCorpus, _expand_paths, _open_split, _SplitWriter, corpus_cache_dir
from .data import write_meta
from .fileio import atomic_directory

ROLES = ("system", "user", "assistant", "tool")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# (blocks rendered so far, spans found) of the render in progress, for the {% generation %} extension.
_TRACKING = contextvars.ContextVar("chat_generation_tracking", default=None)


class ChatTemplateError(DataError):
    """A tokenizer has no chat template, or its template cannot render or delimit a conversation."""


def _environment():
    """A jinja environment with transformers' options, filters and globals for chat templates."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(Extension):
        """``{% generation %}...{% endgeneration %}``: records where the block's output lands in the text."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(len(block) for block in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the rendered text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationSpans, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


class ChatTemplate:
    """A compiled chat template and the special-token variables it renders with.

    Args:
        source: the jinja template text.
        variables: template variables, e.g. {"bos_token": "<s>", "eos_token": "</s>"}.
    """

    def __init__(self, source: str, variables: dict[str, str]):
        import jinja2

        self.source, self.variables = source, dict(variables)
        self.has_generation_blocks = bool(_GENERATION_TAG.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"the chat template does not parse (line {error.lineno}): {error}") from None

    @classmethod
    def of(cls, tokenizer) -> ChatTemplate:
        """The template of ``tokenizer`` (an HFTokenizer); ChatTemplateError naming it when it has none."""
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            where = getattr(tokenizer, "path", "the byte-level tokenizer")
            raise ChatTemplateError(f"data.format=chat needs a tokenizer with a chat_template; {where} has none: "
                                    "set data.tokenizer to one whose tokenizer_config.json (beside its tokenizer.json) "
                                    "holds a chat_template")
        return cls(source, tokenizer.template_tokens)

    def fingerprint(self) -> str:
        """A hash of the template and its variables (part of a chat token cache's key)."""
        return hashlib.sha256(json.dumps([self.source, self.variables], sort_keys=True).encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the (start, end) character spans of its ``{% generation %}`` blocks.

        Raises:
            ChatTemplateError: the template raised (raise_exception) or failed.
        """
        import jinja2

        blocks, spans = [], []
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **self.variables):
                blocks.append(block)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), spans

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant messages.

        Raises:
            ChatTemplateError: without generation blocks, a template whose render of a shorter conversation
                is not a prefix of the longer one's (such a template needs ``{% generation %}`` blocks).
        """
        text, spans = self.render(messages)
        if self.has_generation_blocks:
            return text, spans
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, _ = self.render(messages[:index], add_generation_prompt=True)
            through, _ = self.render(messages[: index + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise ChatTemplateError(
                    f"the chat template renders message {index} (assistant) differently once later messages follow, "
                    "so its assistant tokens cannot be found by prefixes; mark them with {% generation %} ... "
                    "{% endgeneration %} in the template")
            spans.append((len(before), len(through)))
        return text, spans


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation (apply_chat_template(messages, tokenize=True)'s ids) and its
    loss mask: 1 for each token that overlaps an assistant span, else 0.

    Args:
        tokenizer: an HFTokenizer (encode_with_offsets).
        template: the tokenizer's ChatTemplate.
        messages: [{"role": ..., "content": ...}, ...].
    """
    text, spans = template.assistant_spans(messages)
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask = [int(any(start < span_end and end > span_start for span_start, span_end in spans))
            for start, end in offsets]
    return ids, mask


def read_conversations(path: str):
    """Yields (line number, messages) of a jsonl file of {"messages": [{"role", "content"}, ...]} lines.

    Raises:
        DataError: naming the file and line of a line that is not JSON, has no "messages" list, a message
            without string "role" / "content", an unknown role, or no assistant message.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not a JSON line ({error.msg} at column {error.colno})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise DataError(f'{where}: expected an object with a non-empty "messages" list')
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                    raise DataError(f'{where}: message {index} needs a string "content"')
                if message.get("role") not in ROLES:
                    raise DataError(f"{where}: message {index} has role {message.get('role')!r}; "
                                    f"expected one of {', '.join(ROLES)}")
            if not any(message["role"] == "assistant" for message in messages):
                raise DataError(f"{where}: the conversation has no assistant message to learn from")
            yield number, messages


class _RowPacker:
    """Lays a split's conversations out in rows of seq_len tokens, none crossing the end of a row: a
    conversation that does not fit the rest of the row starts the next one, the rest becomes padding
    (a document of its own, no loss). batches.py cuts rows at multiples of seq_len, so every
    conversation is seen whole, its attention and positions starting at its first token."""

    def __init__(self, writer: _SplitWriter, seq_len: int, pad_id: int):
        self.writer, self.seq_len, self.pad_id = writer, seq_len, pad_id
        self.room = seq_len
        self.conversations = 0

    def _pad(self, count: int) -> None:
        self.writer.add(np.full(count, self.pad_id, dtype=np.int64), np.zeros(count, dtype=np.uint8))

    def add(self, ids: list[int], loss_mask: list[int]) -> None:
        if len(ids) > self.room:
            self._pad(self.room)
            self.room = self.seq_len
        mask = np.asarray(loss_mask, dtype=np.uint8)
        # A row's last target is the next row's first token: no conversation's first token is learned from
        # what came before it.
        mask[0] = 0
        self.writer.add(np.asarray(ids, dtype=np.int64), mask)
        self.room = self.room - len(ids) or self.seq_len
        self.conversations += 1

    def finish(self) -> None:
        """Pad the last row, plus the one token its last target is."""
        self._pad((self.room % self.seq_len) + 1)


def load_chat_corpus(cfg: DataConfig, tokenizer, build: bool = True) -> tuple[TokenCorpus, TokenCorpus]:
    """The (train, eval) corpora of chat jsonl files, with loss masks; tokenized on the first call.

    Conversations longer than ``cfg.seq_len`` tokens are dropped (counted in meta.json and the run's
    summary): cut, they would teach replies that stop mid-sentence. Without eval_files every
    ``round(1 / eval_fraction)``-th conversation is held out.

    Args:
        cfg: the data section (format chat, source files, packed).
        tokenizer: an HFTokenizer with a chat_template.
        build: False on processes that must find the cache built by another one.
    Raises:
        DataError: a malformed line (naming the file and line), no chat template, or an empty split.
    """
    template = ChatTemplate.of(tokenizer)
    cache_dir = corpus_cache_dir(cfg, chat_template=template.fingerprint())
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        if not build:
            raise DataError(f"token cache {cache_dir} is missing; the main process should have built it")
        _build_chat_cache(cfg, tokenizer, template, cache_dir)
    return _open_split(cache_dir, "train"), _open_split(cache_dir, "eval")


def _build_chat_cache(cfg: DataConfig, tokenizer, template: ChatTemplate, cache_dir: str) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    pad_id = next((i for i in (tokenizer.pad_id, tokenizer.eos_id) if i is not None), 0)
    eval_every = max(2, round(1 / cfg.eval_fraction))
    eval_files = _expand_paths(cfg.eval_files, "data.eval_files")
    # Without eval files the held-out conversations come from the training files (split None: every n-th).
    sources = [(path, "train" if eval_files else None) for path in _expand_paths(cfg.train_files, "data.train_files")]
    sources += [(path, "eval") for path in eval_files]
    with atomic_directory(cache_dir, keep_existing=True) as tmp:
        writers = {split: _SplitWriter(tmp, split, dtype, loss_mask=True) for split in ("train", "eval")}
        packers = {split: _RowPacker(writer, cfg.seq_len, pad_id) for split, writer in writers.items()}
        dropped = {"train": 0, "eval": 0}
        index = 0
        try:
            for path, fixed_split in sources:
                for number, messages in read_conversations(path):
                    split = fixed_split or ("eval" if index % eval_every == eval_every - 1 else "train")
                    index += fixed_split is None
                    try:
                        ids, mask = encode_conversation(tokenizer, template, messages)
                    except ChatTemplateError as error:
                        raise ChatTemplateError(f"{path}:{number}: {error}") from None
                    if not any(mask[1:]):
                        raise DataError(f"{path}:{number}: the assistant messages render to no tokens to learn")
                    if len(ids) > cfg.seq_len:
                        dropped[split] += 1
                    else:
                        packers[split].add(ids, mask)
            conversations = {split: packer.conversations for split, packer in packers.items()}
            if not all(conversations.values()):
                raise DataError(f"the chat data yields {conversations['train']} training and {conversations['eval']} "
                                f"eval conversations of at most data.seq_len={cfg.seq_len} tokens ({dropped['train']} "
                                f"and {dropped['eval']} longer ones dropped); both must be > 0")
            for packer in packers.values():
                packer.finish()
        except BaseException:
            for writer in writers.values():  # atomic_directory discards the files: close them first
                writer.close_files()
            raise
        write_meta(tmp, writers, tokenizer.eos_id, conversations=conversations, dropped=dropped)
