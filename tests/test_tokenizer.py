"""Tokenizer from the GGUF: matches HF's reading of the same file, digits split like
llama.cpp, the chat template, and incremental detokenisation across split UTF-8."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from chunkserve.model.loader import open_gguf

TEXTS = [
    "Hello, world! The year 2024 had 366 days.",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "naïve café — déjà vu; Größe; 東京は日本の首都です。🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path, open_gguf(gguf_path))


def test_digits_split_individually(tok: Tokenizer) -> None:
    ids = tok.encode("2024")
    assert len(ids) == 4
    assert tok.decode(ids) == "2024"


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == 1 and tok.eos_token_ids == (2,)
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert tok.decode([1], skip_special_tokens=False) == "<|im_start|>"


def test_roundtrip(tok: Tokenizer) -> None:
    for text in TEXTS[:4]:
        assert tok.decode(tok.encode(text)) == text


def test_matches_hf_tokenizer_from_same_gguf(tok: Tokenizer, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for text in TEXTS:
        assert tok.encode(text) == hf(text, add_special_tokens=True)["input_ids"], text


def test_chat_template(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
        "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert with_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    messages = [{"role": "user", "content": "Hi"}]
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids == tok.encode(tok.apply_chat_template(messages))


def test_chat_template_rejects_bad_messages(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    deltas = [detok.add_tokens([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_holds_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # an emoji split over byte tokens
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert detok.add_tokens(ids[:1]) == ""
    assert "".join(detok.add_tokens([t]) for t in ids[1:]) == "🙂"
