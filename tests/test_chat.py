"""Chat SFT data: rendering and assistant masks against transformers, packing, errors, training on it."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from flashformer.batches import IGNORE_INDEX, TrainBatches, eval_batches
from flashformer.chat import ChatTemplate, ChatTemplateError, encode_conversation, load_chat_corpus
from flashformer.data import DataConfig, DataError
from flashformer.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ChatML with a default system prompt, a tool role rendered through tojson, block tags on lines of their
# own (trim_blocks / lstrip_blocks decide the newlines) and {% generation %} around each reply.
MARKED_TEMPLATE = """{{ bos_token }}
{% if messages[0].role != 'system' %}
<|im_start|>system
You are a small model.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>
{% endgeneration %}
    {% elif message.role == 'tool' %}
<|im_start|>tool
{{ message.content | tojson }}<|im_end|>
    {% elif message.role == 'system' and not loop.first %}
{{ raise_exception('a system message must come first') }}
    {% else %}
<|im_start|>{{ message.role }}
{{ message.content | trim }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
UNMARKED_TEMPLATE = MARKED_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}\n", "")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "  Thanks!  "},
     {"role": "assistant", "content": "Merci, café ☕ ?"}, {"role": "user", "content": "And again?"},
     {"role": "assistant", "content": "Encore: merci."}],
    [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me look."},
     {"role": "tool", "content": "<b>sunny</b> \"22°C\""}, {"role": "assistant", "content": "Sunny, 22 degrees."}],
]


def write_tokenizer_config(directory, template):
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "chat_template": template}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def marked_dir(tmp_path_factory):
    """A BPE tokenizer.json trained here, its tokens and the marked template in tokenizer_config.json."""
    directory = str(tmp_path_factory.mktemp("marked"))
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["user assistant system tool model"] * 20
    train_bpe(text, 320, os.path.join(directory, "tokenizer.json"),
              special_tokens=("<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"))
    write_tokenizer_config(directory, MARKED_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def unmarked_dir(marked_dir, tmp_path_factory):
    """The same tokenizer.json with the template without generation blocks."""
    directory = str(tmp_path_factory.mktemp("unmarked"))
    shutil.copyfile(os.path.join(marked_dir, "tokenizer.json"), os.path.join(directory, "tokenizer.json"))
    write_tokenizer_config(directory, UNMARKED_TEMPLATE)
    return directory


def transformers_encoding(directory, messages):
    """(ids, assistant mask) of transformers' apply_chat_template over the marked template."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(directory)
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                 chat_template=MARKED_TEMPLATE)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("template_dir", ["marked_dir", "unmarked_dir"])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_and_assistant_mask_equal_transformers(template_dir, index, marked_dir, request):
    """Generation blocks (transformers' own derivation) and prefixes (ours, without blocks) give transformers'
    ids and assistant mask."""
    directory = request.getfixturevalue(template_dir)
    tokenizer = load_tokenizer(directory)
    template = ChatTemplate.of(tokenizer)
    assert template.has_generation_blocks == (template_dir == "marked_dir")
    ids, mask = encode_conversation(tokenizer, template, CONVERSATIONS[index])
    expected_ids, expected_mask = transformers_encoding(marked_dir, CONVERSATIONS[index])
    assert ids == expected_ids
    assert mask == expected_mask
    assert 0 < sum(mask) < len(mask)
    text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert text == "".join(m["content"] + "<|im_end|>\n" for m in CONVERSATIONS[index] if m["role"] == "assistant")


def test_template_errors_are_named(unmarked_dir, tmp_path):
    template = ChatTemplate.of(load_tokenizer(unmarked_dir))
    with pytest.raises(ChatTemplateError, match="a system message must come first"):
        template.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    # The last reply rendered apart from the others: prefixes cannot find the earlier replies' tokens.
    unstable = ChatTemplate("{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match=r"message 1 \(assistant\).*generation"):
        unstable.assistant_spans([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                  {"role": "user", "content": "c"}])
    with pytest.raises(ChatTemplateError, match="needs a tokenizer with a chat_template"):
        ChatTemplate.of(ByteTokenizer())
    bare = tmp_path / "bare"
    bare.mkdir()
    train_bpe(["hello world"] * 10, 260, bare / "tokenizer.json")
    with pytest.raises(ChatTemplateError, match=f"{bare / 'tokenizer.json'} has none"):
        ChatTemplate.of(load_tokenizer(bare))


def chat_config(tmp_path, lines, tokenizer_dir, seq_len=64, **fields):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return DataConfig(source="files", format="chat", packing="packed", train_files=[str(path)], seq_len=seq_len,
                      tokenizer=tokenizer_dir, cache_dir=str(tmp_path / "cache"), **fields)


@pytest.mark.parametrize("line, message", [
    ("{not json", r"chat.jsonl:2: not a JSON line"),
    ('{"text": "hello"}', r'chat.jsonl:2: expected an object with a non-empty "messages" list'),
    ('{"messages": [{"role": "bot", "content": "hi"}]}', r"chat.jsonl:2: message 0 has role 'bot'; expected one of"),
    ('{"messages": [{"role": "user"}]}', r'chat.jsonl:2: message 0 needs a string "content"'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"chat.jsonl:2: the conversation has no assistant"),
])
def test_malformed_lines_name_file_and_line(tmp_path, unmarked_dir, line, message):
    cfg = chat_config(tmp_path, [json.dumps({"messages": CONVERSATIONS[0]}), line], unmarked_dir)
    with pytest.raises(DataError, match=message):
        load_chat_corpus(cfg, load_tokenizer(unmarked_dir))


def test_chat_needs_files_and_packing():
    with pytest.raises(DataError, match="data.format=chat needs data.source=files .* data.packing=packed"):
        DataConfig(source="files", format="chat", train_files=["x.jsonl"]).validate()


def expected_targets(input_ids, cu_seqlens, encodings, pad_id):
    """Targets of a packed batch from transformers' encodings: each segment is padding or one whole
    conversation, whose targets are its next tokens where transformers' mask is 1 (never past its end)."""
    flat = input_ids.flatten().tolist()
    targets = [IGNORE_INDEX] * len(flat)
    seen = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        segment = flat[start:end]
        if all(t == pad_id for t in segment):
            continue
        index = next(i for i, (ids, _) in enumerate(encodings) if ids == segment)
        seen.append(index)
        ids, mask = encodings[index]
        for offset in range(len(ids) - 1):
            if mask[offset + 1]:
                targets[start + offset] = ids[offset + 1]
    return torch.tensor(targets, device=input_ids.device).view_as(input_ids), seen


def test_conversations_packed_whole_with_assistant_targets_only(tmp_path, unmarked_dir, marked_dir):
    too_long = [{"role": "user", "content": "tell me a story " * 40}, {"role": "assistant", "content": "No."}]
    line_conversations = [CONVERSATIONS[i % 3] for i in range(5)] + [too_long] + [CONVERSATIONS[i % 3] for i in range(6)]
    lines = [json.dumps({"messages": c}) for c in line_conversations]
    cfg = chat_config(tmp_path, lines, unmarked_dir, seq_len=128, eval_fraction=0.25)
    tokenizer = load_tokenizer(unmarked_dir)
    train, held_out = load_chat_corpus(cfg, tokenizer)
    # Every 4th conversation (the 4th, 8th, 12th line) is held out; the long one (6th line) is dropped.
    assert (train.dropped, held_out.dropped) == (1, 0)
    encodings = [transformers_encoding(marked_dir, c) for c in CONVERSATIONS]
    rows = eval_batches(train, cfg, num_rows=1000, micro_batch=1000)[0]
    targets, seen = expected_targets(rows.input_ids, rows.cu_seqlens, encodings, tokenizer.pad_id)
    trained = [c for line, c in enumerate(line_conversations) if line % 4 != 3 and c is not too_long]
    assert sorted(seen) == sorted(CONVERSATIONS.index(c) for c in trained)
    assert torch.equal(rows.targets, targets)
    assert int(train.loss_mask.sum()) == int((targets != IGNORE_INDEX).sum())
    # One row per micro batch gives the same rows (a row's masked targets never reach its input ids).
    singles = eval_batches(train, cfg, num_rows=1000, micro_batch=1)
    assert torch.equal(torch.cat([b.input_ids for b in singles]), rows.input_ids)
    assert torch.equal(torch.cat([b.targets for b in singles]), rows.targets)
    # A second load maps the cache, with the same masks.
    again, _ = load_chat_corpus(cfg, tokenizer)
    assert np.array_equal(again.loss_mask, train.loss_mask) and again.dropped == 1


def test_training_loss_is_the_mean_over_assistant_tokens(tmp_path, marked_dir):
    """The trainer's loss on a batch of configs/sft-tiny.yaml equals cross-entropy by hand over the tokens
    transformers marks as the assistant's."""
    from flashformer.train import load_train_config
    from flashformer.train.loop import Trainer
    from flashformer.train.step import lm_loss

    directory = os.path.join(ROOT, "configs", "sft-tiny")
    cfg = load_train_config(os.path.join(ROOT, "configs", "sft-tiny.yaml"),
                            [f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
                             f"data.tokenizer={directory}",
                             f"data.train_files=[{os.path.join(directory, 'conversations.jsonl')}]"])
    trainer = Trainer(cfg)
    try:
        batch = trainer.batches.next_step()[0].to(trainer.device)
        with open(os.path.join(directory, "conversations.jsonl")) as f:
            conversations = [json.loads(line)["messages"] for line in f]
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(directory)
        encodings = []
        for messages in conversations:
            # The assistant's text, found in transformers' rendering: each reply and its end of turn.
            text, spans, cursor = hf.apply_chat_template(messages, tokenize=False), [], 0
            for message in (m for m in messages if m["role"] == "assistant"):
                header, reply = "<|im_start|>assistant\n", message["content"] + "<|im_end|>\n"
                start = text.index(header + reply, cursor) + len(header)
                spans.append((start, start + len(reply)))
                cursor = start + len(reply)
            encoded = hf(text, add_special_tokens=False, return_offsets_mapping=True)
            assert encoded["input_ids"] == list(hf.apply_chat_template(messages, tokenize=True)["input_ids"])
            mask = [int(any(a < e and b > s for s, e in spans)) for a, b in encoded["offset_mapping"]]
            encodings.append((encoded["input_ids"], mask))
        targets, _ = expected_targets(batch.input_ids, batch.cu_seqlens, encodings, trainer.tokenizer.pad_id)
        with torch.no_grad():
            logits = trainer.model(batch.input_ids, **batch.model_kwargs()).float()
            chosen = targets != IGNORE_INDEX
            log_probs = torch.log_softmax(logits[chosen], dim=-1)
            by_hand = -log_probs[torch.arange(int(chosen.sum())), targets[chosen]].mean()
            assert torch.allclose(lm_loss(trainer.model, batch), by_hand, rtol=1e-6, atol=1e-6)
        assert 0 < int(chosen.sum()) < chosen.numel() // 2
    finally:
        trainer.close()


def test_sft_recipe_trains_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "flashformer.cli", "train", "configs/sft-tiny.yaml", "steps=3", "eval_every=3",
         "log_every=1", f"out_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "sample.max_new_tokens=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "conversations longer than data.seq_len=128 dropped: 0 train, 0 eval" in result.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert any("eval_loss" in r for r in records)
    assert "<|im_start|>assistant" in result.stdout  # the sample's prompt, rendered back


def test_eval_files_hold_the_eval_split_and_an_empty_split_is_refused(tmp_path, unmarked_dir):
    tokenizer = load_tokenizer(unmarked_dir)
    eval_path = tmp_path / "held_out.jsonl"
    eval_path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    lines = [json.dumps({"messages": CONVERSATIONS[0]})] * 8
    train, held_out = load_chat_corpus(chat_config(tmp_path, lines, unmarked_dir, seq_len=128,
                                                   eval_files=[str(eval_path)]),
                                       tokenizer)
    ids, _ = encode_conversation(tokenizer, ChatTemplate.of(tokenizer), CONVERSATIONS[0])
    per_row = 128 // len(ids)
    assert train.num_tokens == -(-8 // per_row) * 128 + 1  # all 8 in training, whole rows of them, + 1 token
    assert held_out.num_tokens == 128 + 1 and int(held_out.loss_mask.sum()) > 0
    with pytest.raises(DataError, match=r"yields 0 training and 0 eval conversations .*\(8 and 1 longer ones dropped"):
        load_chat_corpus(chat_config(tmp_path, lines, unmarked_dir, seq_len=8, eval_files=[str(eval_path)]),
                         tokenizer)
