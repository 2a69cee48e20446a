"""Tokenizers against transformers: special tokens applied as AutoTokenizer applies them (no downloads:
the tokenizers are trained here and saved with transformers' own save_pretrained)."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from flashformer.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

TEXTS = ["hello world", "  leading spaces and <s> inline specials </s>", "", "naïve café, 42!", "</s>"]
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog"] * 30 + ["naïve café 0123456789"] * 10


def small_bpe(special_tokens=("<unk>", "<s>", "</s>", "<pad>")):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def save_hf(tokenizer, directory, **kwargs):
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def assert_same_encoding(ours, theirs):
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                       theirs.pad_token_id)


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (True, True), (False, False)])
def test_llama_style_config_equals_auto_tokenizer(tmp_path, add_bos, add_eos):
    theirs = save_hf(small_bpe(), tmp_path, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                     unk_token="<unk>", add_bos_token=add_bos, add_eos_token=add_eos)
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    assert_same_encoding(ours, theirs)
    assert ours.encode("hi")[:1] == ([ours.bos_id] if add_bos else ours.encode("hi", add_special_tokens=False)[:1])


def test_tokenizer_json_post_processor_applies_without_add_bos_token(tmp_path):
    """Llama 3 style: no add_bos_token in the config, tokenizer.json's TemplateProcessing adds the bos."""
    tokenizer = small_bpe(("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    theirs = save_hf(tokenizer, tmp_path, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "add_bos_token" not in config
    eot, end = tokenizer.token_to_id("<|eot_id|>"), tokenizer.token_to_id("<|end_of_text|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": [end, eot]}))
    ours = load_tokenizer(tmp_path)
    assert_same_encoding(ours, theirs)
    assert ours.encode("hello")[0] == bos
    assert ours.eos_ids == (end, eot)  # generation stops at either, as transformers' generate does


def test_special_tokens_survive_save(tmp_path):
    save_hf(small_bpe(), tmp_path / "hf", bos_token="<s>", eos_token="</s>", add_bos_token=True)
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": [2, 3]}')
    ours = load_tokenizer(tmp_path / "hf")
    (tmp_path / "copy").mkdir()
    ours.save(tmp_path / "copy")
    again = load_tokenizer(tmp_path / "copy")
    assert again.encode("hello world") == ours.encode("hello world") and again.eos_ids == (2, 3)
    assert AutoTokenizer.from_pretrained(tmp_path / "copy")("hello world")["input_ids"] == ours.encode("hello world")


def test_bare_tokenizer_json_and_bytes(tmp_path):
    """train_bpe's tokenizer.json alone: no special tokens added, <|endoftext|> ends documents."""
    tokenizer = train_bpe(CORPUS, 280, tmp_path / "tokenizer.json")
    assert tokenizer.eos_id == tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.eos_ids == (0,)
    assert tokenizer.bos_id is None and tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)
    byte = ByteTokenizer()
    assert (byte.encode("hi"), byte.bos_id, byte.eos_ids) == ([104, 105], None, (256,))
