"""Tokenizer from the model file (GGUF metadata or ``tokenizer.json``), its chat template,
and incremental detokenisation that is right across tokens splitting a UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.model.source import ModelSource

# Byte-level BPE pre-tokenizers by ``tokenizer.ggml.pre``: the regexes llama.cpp splits text
# with for that value (src/llama-vocab.cpp), each applied in turn to the pieces of the one
# before, as the model's own tokenizer.json splits it (its regex, as HF writes it).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: Llama 3's with one digit a piece.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# DeepSeek's (their tokenizer.json files: a Sequence of Splits, then the byte-level
# alphabet). V3 / R1 ("deepseek-v3"): digits in runs of up to 3, then CJK ideographs and
# kana, then Llama 3's regex with punctuation and symbols (\p{P}, \p{S}) for its "other".
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM ("deepseek-llm"): lines, then words of cased letters (the class below), ASCII
# and CJK punctuation, trailing spaces, CJK / Hangul / the scripts from U+0800, digit runs.
# Six of the class's code points change under NFC (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126,
# U+212A), escaped so that no editor normalises them: llama.cpp's source carries three
# normalised, which makes those ranges run backwards.
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕ"
    "Ἐ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ"
    "\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲"
    "𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
# DeepSeek Coder ("deepseek-coder"): lines, letters, punctuation, CJK, each digit alone.
_DEEPSEEK_CODER_SPLITS = (
    "[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}",
)
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"),
        (_LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), (_QWEN2_SPLIT,)),
    # GPT-2's regex after cutting out every digit on its own.
    **dict.fromkeys(
        ("starcoder", "refact", "smollm", "command-r", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2_SPLIT),
    ),
    "deepseek-v3": _DEEPSEEK_V3_SPLITS,
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
}
# What llama.cpp sets for a ``pre`` beyond its regexes: whole pieces found in the vocabulary
# skip the merges (Llama 3's tokenizer.json: ``ignore_merges``), and BOS added by default.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}
# HF's Qwen2 tokenizer.json normalises to NFC first (llama.cpp does not: we follow HF's).
_NFC = {"qwen2", "deepseek-r1-qwen"}
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    """The pre-tokenizer of GGUF ``tokenizer.ggml.pre`` ``pre``: llama.cpp's regexes for it,
    then the byte-level alphabet. A value we do not know is a ValueError (llama.cpp now falls
    back to a "default" regex no model's tokenizer.json has: a silently different split)."""
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer: GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}); pass --tokenizer with the model's "
            f"tokenizer.json directory"
        )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZERS[pre]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _gguf_bpe_tokenizer(reader: Any) -> HFTokenizer:
    from chunkserve.model.source import _field

    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    pre = _field(reader, "tokenizer.ggml.pre")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    )
    tk.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    if pre in _NFC:
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(t == _GGUF_TOKEN_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED)
    ]
    tk.add_tokens(added)
    _add_special_tokens(tk, reader, default_bos=pre in _IGNORE_MERGES)
    return tk


def _add_special_tokens(tk: HFTokenizer, reader: Any, default_bos: bool) -> None:
    """BOS / EOS around every encoding where the file's ``add_bos_token`` / ``add_eos_token``
    ask (``default_bos``: llama.cpp's default without the flag)."""
    from chunkserve.model.source import _field

    tokens = _field(reader, "tokenizer.ggml.tokens")
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", default_bos)
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", False)
    special, before, after = {}, "", ""
    for flag, key in ((add_bos, "bos"), (add_eos, "eos")):
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if flag and tid is not None:
            special[tokens[int(tid)]] = int(tid)
            if key == "bos":
                before = tokens[int(tid)] + " "
            else:
                after = " " + tokens[int(tid)]
    tk.post_processor = (
        processors.TemplateProcessing(
            single=f"{before}$A{after}",
            pair=f"{before}$A{after} {before}$B{after}",
            special_tokens=list(special.items()),
        )
        if special
        else None
    )


def _gguf_sentencepiece_tokenizer(path: Path, reader: Any, kind: str) -> HFTokenizer:
    """SentencePiece-style vocabularies (``tokenizer.ggml.model`` llama, ...): transformers'
    GGUF builders (they know each family's quirks: Gemma's merge order and spelled-out
    spaces, Phi-3's prefix space), fed from our open reader. Measured on a 262,144-token
    vocabulary (2 loaded cores): ``AutoTokenizer.from_pretrained(gguf_file=)`` took 68 s, 53 s
    of it re-parsing the whole file with gguf-py for the model config; from our reader the
    builder takes ~13 s (merges derived from the scores: 6-9 s)."""
    from chunkserve.model.source import _field

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # an older transformers: its reader, slower
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return hf.backend_tokenizer
    info = {
        name: _field(reader, f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in reader.fields
    }
    tk, _ = convert_gguf_tokenizer(_field(reader, "general.architecture"), info)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    # (transformers' reference keeps Gemma 4's template-written BOS single).
    _add_special_tokens(tk, reader, default_bos=kind != "gemma4")
    return tk


class Tokenizer:
    """Encode/decode through ``tokenizers``; chat templates rendered with Jinja2 the way HF
    transformers renders them."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._tk = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # The ``eos_token`` a chat template sees (None: the first of ``eos_token_ids``).
        self.eos_token_id: int | None = None
        self._compiled_template: Any = None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_source(
        cls, source: ModelSource, reader: Any = None, tokenizer_path: str | None = None
    ) -> Tokenizer:
        if tokenizer_path is not None:
            return cls.from_hf_dir(Path(tokenizer_path))
        if source.kind == "hf":
            return cls.from_hf_dir(source.path)
        return cls.from_gguf(source.path, reader)

    @classmethod
    def from_gguf(cls, path: Path, reader: Any) -> Tokenizer:
        from chunkserve.model.source import _field

        kind = _field(reader, "tokenizer.ggml.model")
        if kind == "gpt2":
            tk = _gguf_bpe_tokenizer(reader)
        elif kind == "llama" and _field(reader, "general.architecture") in _GEMMA_ARCHS:
            tk = _gguf_gemma_tokenizer(reader)
        elif kind is not None:
            tk = _gguf_sentencepiece_tokenizer(path, reader, kind)
        else:
            raise ValueError(f"model: GGUF file {str(path)!r} carries no tokenizer")
        eos = [
            int(t)
            for t in (
                _field(reader, "tokenizer.ggml.eos_token_id"),
                _field(reader, "tokenizer.ggml.eot_token_id"),
            )
            if t is not None
        ]
        bos = _field(reader, "tokenizer.ggml.bos_token_id")
        return cls(
            tk,
            eos_token_ids=sorted(set(eos)),
            bos_token_id=None if bos is None else int(bos),
            chat_template=_field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {str(path)!r}")
        tk = HFTokenizer.from_file(str(file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else tk.token_to_id(value)

        # Every list counts: tokenizer_config.json's eos_token, generation_config.json's
        # and config.json's eos_token_id (Llama 3: <|eot_id|> in one, three ids in another).
        eos_ids: list[int] = []
        eos = token_id(cfg.get("eos_token"))
        if eos is not None:
            eos_ids.append(eos)
        for name in ("generation_config.json", "config.json"):
            if (path / name).is_file():
                listed = json.loads((path / name).read_text()).get("eos_token_id")
                values = listed if isinstance(listed, list) else [listed]
                eos_ids += [int(v) for v in values if isinstance(v, int)]
        tokenizer = cls(
            tk,
            eos_token_ids=sorted(set(eos_ids)),
            bos_token_id=token_id(cfg.get("bos_token")),
            chat_template=template,
        )
        # The template's eos_token is the tokenizer's own, not the smallest EOS id.
        tokenizer.eos_token_id = eos
        return tokenizer

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (for grammars over the vocabulary)."""
        return self._tk

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_keeping(
        self, token_ids: Sequence[int], skip_special_tokens: bool, keep: frozenset[int]
    ) -> str:
        """``decode``, where the special tokens in ``keep`` are written even when the others
        are skipped (a parser's own markers)."""
        if not skip_special_tokens or not keep:
            return self.decode(token_ids, skip_special_tokens)
        special = self.special_token_ids
        ids = [t for t in token_ids if t not in special or t in keep]
        return self._tk.decode(ids, skip_special_tokens=False)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (what ``skip_special_tokens`` drops)."""
        cached = self.__dict__.get("_special_ids")
        if cached is None:
            decoder = self._tk.get_added_tokens_decoder()
            cached = frozenset(i for i, t in decoder.items() if t.special)
            self.__dict__["_special_ids"] = cached
        return cached

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token, else None."""
        tid = self._tk.token_to_id(text)
        return tid if tid is not None and tid in self.special_token_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (for logprobs)."""
        return self._tk.decode([token_id], skip_special_tokens=False)

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError(
                "messages: this model has no chat template (none in tokenizer_config.json's "
                "chat_template, chat_template.jinja or the GGUF's tokenizer.chat_template); "
                "send a prompt to /v1/completions instead"
            )
        _check_messages(messages)
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        special = {}
        for name, tid in (
            ("bos_token", self.bos_token_id),
            ("eos_token", self._template_eos()),
        ):
            special[name] = self.id_to_token(tid) if tid is not None else ""
        return self._compiled_template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **special,
            **kwargs,
        )

    def _template_eos(self) -> int | None:
        if self.eos_token_id is not None:
            return self.eos_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def template_uses(self, variable: str) -> bool:
        """Whether the chat template reads ``variable`` (e.g. ``tools``)."""
        if not self.chat_template:
            return False
        cache = self.__dict__.setdefault("_template_vars", {})
        if variable not in cache:
            from jinja2 import Environment, meta
            from jinja2.ext import loopcontrols

            try:
                ast = Environment(extensions=[loopcontrols]).parse(self.chat_template)
                cache[variable] = variable in meta.find_undeclared_variables(ast)
            except Exception:  # an extension tag jinja2 alone does not parse
                cache[variable] = variable in self.chat_template
        return cache[variable]

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        # The template writes BOS where the model wants it (``{{ bos_token }}``) or not at
        # all: encoded without the tokenizer's add-BOS rule, as transformers'
        # apply_chat_template(tokenize=True) does, so BOS is never doubled.
        return self.encode(text, add_special_tokens=False)


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content: must be a string or a list of parts")


def _compile_template(source: str) -> Any:
    """Compile like HF transformers: sandboxed, trim/lstrip blocks, loop controls,
    ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"messages: {message}")

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Text is emitted only once it is stable: a token that ends inside a multi-byte UTF-8
    character decodes to U+FFFD and is held back until the next token completes it. A few
    prompt tokens give the first output token its left context (SentencePiece strips a
    leading space at the start of a decode).
    """

    _CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        keep_special_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep_special_token_ids or ())
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new stable text (may be empty)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode_keeping(ids, self.skip_special_tokens, self.keep)

    def flush(self) -> str:
        """At the end: whatever is left, replacement characters included."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


# ---- Gemma's SentencePiece vocabulary from a GGUF -------------------------------------------
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _gguf_gemma_tokenizer(reader: Any) -> HFTokenizer:
    """A Gemma GGUF's SentencePiece vocabulary (``tokenizer.ggml.model`` "llama", no merges)
    as transformers' GGUF conversion builds it (``GemmaTokenizer``: BPE with byte fallback,
    spaces as "\u2581", merges recovered from the vocabulary in file order; whitespace-only
    tokens stored with real spaces spelled "\u2581"; control tokens special, user-defined ones
    added whole; BOS / EOS as ``add_bos_token`` / ``add_eos_token`` say), built in one pass:
    transformers adds Gemma 3's 6,249 control tokens one by one (minutes for its 262k
    vocabulary on two cores)."""
    from tokenizers import normalizers
    from transformers.tokenization_utils_base import generate_merges

    from chunkserve.model.source import _field

    raw = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(raw))
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
    vocab = {t: i for i, t in enumerate(tokens)}
    # Gemma's scores do not follow its merge order; the file's order does.
    merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    tk = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            unk_token=tokens[int(unk)] if unk is not None else "<unk>",
            byte_fallback=True,
        )
    )
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tk.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == 3]
    )
    tk.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in zip(raw, types)
            if k == 4 and t in vocab
        ]
    )
    single, special = ["$A:0"], []
    for key, first in (("bos", True), ("eos", False)):
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None and _field(reader, f"tokenizer.ggml.add_{key}_token", first):
            single.insert(0 if first else len(single), f"{tokens[int(tid)]}:0")
            special.append((tokens[int(tid)], int(tid)))
    if special:
        tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tk
