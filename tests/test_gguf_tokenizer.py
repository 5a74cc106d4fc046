"""The tokenizer rebuilt from GGUF metadata against transformers' tokenizer of the same
vocabulary, per ``tokenizer.ggml.pre``: the embedded SmolLM2 (smollm), a Qwen2-style and a
Llama-3-style byte-level BPE, a GPT-2 one, and a small SentencePiece one. The BPE vocabularies
are trained here with merges across every boundary (no pre-tokenizer), so that any split that
differs from the model's shows in the ids; each case checks that a wrong ``pre`` does show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.engine.tokenizer import Tokenizer
from chunkserve.model.loader import open_gguf

TEXTS = [
    "Hello, world! The year 2024 had 366 days; pi is 3.14159 and 1234567 > 89.",
    "naïve café — déjà vu; Größe; Ελληνικά; русский текст; 東京は日本の首都です。🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A(B):\n\tpass  \n",
    "I'M here, you'LL see: they've DONE it.\r\n\r\n(a+b)*c = [1, 22, 333, 4444]...",
    "  leading spaces, trailing   ",
    "Numbers: 0 00 000 0000 12345678901234567890; ١٢٣ ٤٥٦",
    "Decomposed: cafe\u0301 nai\u0308ve Ame\u0301lie",  # NFC (Qwen2's normaliser) composes
    # DeepSeek's splits: full-width and curly punctuation, kana, Hangul, the ideographic
    # space, letters beside ASCII punctuation; between letters, those NFC changes (U+1F7D,
    # U+1FBE, U+1FD3, U+1FDB, U+2126 ohm, U+212A kelvin) and two NFC forms.
    "（全角）！？ ‘quoted’ “double” カタカナとひらがな　한국어 텍스트 x.y_z+=1 @home #tag",
    "é\u1f7dé é\u1fbeé é\u1fd3é é\u1fdbé é\u2126é é\u212aé é\u03ceé éKé [a]{b} 🙂   x",
]
# A word the vocabulary has whole but its merges never build (not in the training text):
# Llama 3's tokenizer.json takes it whole (``ignore_merges``), BPE alone would not.
UNMERGED = "Ġzqxjvw"
TEXTS_AND_UNMERGED = [*TEXTS, "so zqxjvw it is"]
CORPUS = TEXTS * 3 + [
    "The quick brown fox jumps over the lazy dog 1999 times.",
    "for i in range(100):\n    print(i, i * 2)\n",
    "Größere Zahlen: 2025, 1000000, 3.5e10. Ça va? Sí, señor.",
]
SPECIAL = ["<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]

# HF tokenizer.json pre-tokenizer regexes of the families (as their tokenizer.json files
# spell them): Llama 3 (meta-llama/Llama-3.2-1B) and Qwen2 (Qwen/Qwen2.5-0.5B).
HF_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hf_qwen2_regex() -> str:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX


# The pre_tokenizer of DeepSeek's tokenizer.json files (deepseek-ai/DeepSeek-V3,
# deepseek-llm-7b-base, deepseek-coder-6.7b-base): "Split" steps ("Isolated") of these
# regexes (as the JSON strings decode), then "ByteLevel" without its regex. DeepSeek LLM's
# letter class is spelled with escapes where NFC would change a code point.
DEEPSEEK_V3_SPLITS = [
    "\\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
DEEPSEEK_LLM_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕ"
    "Ἐ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ"
    "\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲"
    "𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
DEEPSEEK_LLM_SPLITS = [
    "[\r\n]",
    "\\s?[" + DEEPSEEK_LLM_LETTERS + "]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
]
DEEPSEEK_CODER_SPLITS = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+"]


def from_tokenizer_json(splits: list[str], digits: bool = False):
    """The pre-tokenizer a tokenizer.json with these Split regexes defines (``digits``:
    then a "Digits" step, one digit a piece, as DeepSeek Coder's)."""
    import json

    steps: list[dict] = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in splits
    ]
    if digits:
        steps.append({"type": "Digits", "individual_digits": True})
    steps.append(
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    )
    spec = json.loads(HFTokenizer(models.BPE()).to_str())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
    return HFTokenizer.from_str(json.dumps(spec)).pre_tokenizer


def byte_level(split: str | None = None, digits: bool = False):
    if split is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    if digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary whose merges cross words, digits and lines."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS, trainer)
    spec = tk.to_str()
    import json

    model = json.loads(spec)["model"]
    vocab = model["vocab"]
    assert UNMERGED not in vocab
    vocab[UNMERGED] = len(vocab)
    return vocab, [tuple(m) for m in model["merges"]]


def hf_tokenizer(vocab, merges, pre, *, nfc=False, ignore_merges=False, bos=None, special=SPECIAL):
    """The family's tokenizer.json, loaded by transformers."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def write_tokenizer_gguf(out: Path, vocab, merges, pre, **flags) -> Path:
    """The vocabulary as llama.cpp's converter writes a byte-level BPE one (get_vocab_base):
    tokens by id, added special tokens CONTROL, merges as "a b"."""
    import gguf

    w = gguf.GGUFWriter(str(out), "llama")
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(vocab["<|begin_of_text|>"])
    w.add_eos_token_id(vocab["<|endoftext|>"])
    for key, value in flags.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(path, open_gguf(path))


def encodings(tok, texts=TEXTS_AND_UNMERGED) -> list[list[int]]:
    if isinstance(tok, Tokenizer):
        return [tok.encode(t) for t in texts]
    return [tok(t)["input_ids"] for t in texts]


# pre value -> (HF pre-tokenizer, NFC normaliser, ignore_merges, adds BOS)
CASES = {
    "qwen2": (lambda: byte_level(hf_qwen2_regex()), True, False, False),
    "llama-bpe": (lambda: byte_level(HF_LLAMA3), False, True, True),
    "gpt-2": (lambda: byte_level(), False, False, False),
    "starcoder": (lambda: byte_level(digits=True), False, False, False),
    "deepseek-v3": (lambda: from_tokenizer_json(DEEPSEEK_V3_SPLITS), False, False, True),
    "deepseek-llm": (lambda: from_tokenizer_json(DEEPSEEK_LLM_SPLITS), False, False, True),
    # Coder's digits: one a piece (its tokenizer.json's Digits step).
    "deepseek-coder": (
        lambda: from_tokenizer_json(DEEPSEEK_CODER_SPLITS, digits=True),
        False,
        False,
        True,
    ),
}


@pytest.mark.parametrize("pre", list(CASES))
def test_byte_level_bpe_matches_transformers(trained, tmp_path, pre) -> None:
    vocab, merges = trained
    make_pre, nfc, ignore, bos = CASES[pre]
    bos_token = "<|begin_of_text|>" if bos else None
    hf = hf_tokenizer(
        vocab, merges, make_pre(), nfc=nfc, ignore_merges=ignore,
        bos=bos_token,
    )  # fmt: skip
    want = encodings(hf)
    flags = {"add_bos_token": bos}
    got = encodings(ours(write_tokenizer_gguf(tmp_path / "t.gguf", vocab, merges, pre, **flags)))
    assert got == want
    ours_tok = ours(tmp_path / "t.gguf")
    # The pre-tokenizer's pieces themselves (a split no merge crosses shows here only).
    for text in TEXTS:
        mine = ours_tok._tk.pre_tokenizer.pre_tokenize_str(text)
        assert mine == hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text), text
    decoded = [hf.decode(ids, skip_special_tokens=True) for ids in want]
    assert [ours_tok.decode(ids) for ids in got] == decoded
    if ignore:  # and it matters here
        assert encodings(hf_tokenizer(vocab, merges, make_pre(), bos=bos_token)) != want
    # The texts tell the pre-tokenizers apart: every other one gives different ids.
    for other in CASES:
        if other != pre:
            path = write_tokenizer_gguf(tmp_path / f"{other}.gguf", vocab, merges, other, **flags)
            assert encodings(ours(path)) != want, f"{other} splits like {pre}"


def test_embedded_smollm_matches_its_tokenizer_json(gguf_path: Path) -> None:
    """SmolLM2's tokenizer.json (digits one by one, then GPT-2's byte-level regex) over the
    embedded GGUF's vocabulary and merges, against our reading of the GGUF."""
    from chunkserve.model.loader import _field

    reader = open_gguf(gguf_path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    control = [t for t, k in zip(tokens, _field(reader, "tokenizer.ggml.token_type")) if k == 3]
    hf = hf_tokenizer(vocab, merges, byte_level(digits=True), special=control)
    texts = [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]
    assert encodings(ours(gguf_path), texts) == encodings(hf, texts)
    # GPT-2's regex alone (no digit split) gives other ids on these texts.
    assert encodings(hf_tokenizer(vocab, merges, byte_level(), special=control), texts) != (
        encodings(hf, texts)
    )


def test_add_eos_and_bos_flags(trained, tmp_path) -> None:
    vocab, merges = trained
    eos, bos = vocab["<|endoftext|>"], vocab["<|begin_of_text|>"]
    plain = ours(write_tokenizer_gguf(tmp_path / "a.gguf", vocab, merges, "qwen2")).encode("hi")
    both = ours(
        write_tokenizer_gguf(
            tmp_path / "b.gguf", vocab, merges, "qwen2", add_bos_token=True, add_eos_token=True
        )
    ).encode("hi")
    assert both == [bos, *plain, eos]
    no_bos = ours(
        write_tokenizer_gguf(tmp_path / "c.gguf", vocab, merges, "llama-bpe", add_bos_token=False)
    )
    assert no_bos.encode("hi")[0] != bos
    # No flag: llama.cpp adds BOS for Llama 3's pre-tokenizer, not for the others.
    llama3 = ours(write_tokenizer_gguf(tmp_path / "d.gguf", vocab, merges, "llama-bpe"))
    assert llama3.encode("hi")[0] == bos and plain[0] != bos


def test_unknown_pre_tokenizer_is_refused_naming_it(trained, tmp_path) -> None:
    vocab, merges = trained
    for pre in ("tekken", None):
        path = write_tokenizer_gguf(tmp_path / "u.gguf", vocab, merges, pre)
        with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.pre {pre!r}"):
            ours(path)


def test_a_gguf_without_chat_template_has_none(trained, tmp_path) -> None:
    vocab, merges = trained
    tok = ours(write_tokenizer_gguf(tmp_path / "n.gguf", vocab, merges, "qwen2"))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_sentencepiece_matches_transformers(tmp_path) -> None:
    """A SentencePiece-style BPE vocabulary (byte fallback, ``▁`` for spaces) as llama.cpp
    writes one (tokenizer.ggml.model "llama": tokens, scores by merge order, token types; no
    merges), against its tokenizer.json in transformers."""
    import gguf
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tk = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=special, show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tk)
    vocab = tk.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    # SentencePiece BPE scores: later merges score lower; control, unknown and byte pieces 0.
    w.add_token_scores([0.0 if i < len(special) else -float(i) for i in range(len(tokens))])
    w.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - len(special))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    # No add_bos_token: llama.cpp adds BOS to a SentencePiece vocabulary by default.
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = ours(tmp_path / "spm.gguf")
    assert encodings(got) == encodings(hf)
    assert [got.decode(ids) for ids in encodings(got)] == [
        hf.decode(ids, skip_special_tokens=True) for ids in encodings(hf)
    ]


def test_gemma_sentencepiece_matches_transformers_conversion(tmp_path) -> None:
    """A Gemma-style vocabulary as llama.cpp's Gemma converters write one (general.architecture
    gemma3, tokenizer.ggml.model "llama", no merges, scores -1000 for control and user-defined
    tokens, whitespace tokens with real spaces, "\\n" runs user-defined, no space prefix):
    chunkserve's one-pass build gives the ids and text of transformers' conversion of the
    same file (``AutoTokenizer.from_pretrained(gguf_file=...)``)."""
    import gguf
    from transformers import AutoTokenizer

    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "\n\n\n", "\u2581\u2581", "\u2581\u2581\u2581", "[multimodal]"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tk = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(
        vocab_size=1200, special_tokens=control + user + byte_pieces, show_progress=False
    )
    tk.train_from_iterator(CORPUS, trainer)
    vocab = tk.get_vocab()
    # As the file spells them: whitespace-only pieces with real spaces.
    tokens = [t.replace("\u2581", " ") if set(t) == {"\u2581"} and len(t) > 1 else t
              for t in sorted(vocab, key=vocab.get)]  # fmt: skip
    n_special = len(control) + len(user) + len(byte_pieces)
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * (len(control) + len(user)) + [0.0] * 256
                       + [-float(i) for i in range(len(tokens) - n_special)])  # fmt: skip
    w.add_token_types([3] * len(control) + [4] * len(user) + [6] * 256
                      + [1] * (len(tokens) - n_special))  # fmt: skip
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma.gguf")
    got = ours(tmp_path / "gemma.gguf")
    texts = [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>\n", "a  b   c\n\n\nd", "x[multimodal]y"]
    assert encodings(got, texts) == encodings(hf, texts)
    assert [got.decode(ids) for ids in encodings(got, texts)] == [
        hf.decode(ids, skip_special_tokens=True) for ids in encodings(hf, texts)
    ]


def test_deepseek_llm_letters_are_cased_letters_in_order() -> None:
    """DeepSeek LLM's letter class (ours and the test's) as its tokenizer.json has it:
    ranges that ascend and hold only cased letters (Lu, Ll, Lt; or unassigned). An editor
    normalising the file to NFC would break it (U+1F7D -> U+03CE ends a range below its
    start; U+212A -> "K" starts one at ASCII)."""
    import unicodedata

    from chunkserve.engine.tokenizer import _DEEPSEEK_LLM_LETTERS

    assert _DEEPSEEK_LLM_LETTERS == DEEPSEEK_LLM_LETTERS
    cls, i = DEEPSEEK_LLM_LETTERS, 0
    while i < len(cls):
        if cls[i + 1 : i + 2] == "-":
            lo, hi, i = cls[i], cls[i + 2], i + 3
        else:
            lo = hi = cls[i]
            i += 1
        assert lo <= hi, (hex(ord(lo)), hex(ord(hi)))
        cats = {unicodedata.category(chr(c)) for c in range(ord(lo), ord(hi) + 1)}
        assert cats <= {"Lu", "Ll", "Lt", "Cn"}, (hex(ord(lo)), hex(ord(hi)), cats)
    assert {"\u1f7d", "\u1fbe", "\u1fd3", "\u1fdb", "\u2126", "\u212a"} <= set(cls)
