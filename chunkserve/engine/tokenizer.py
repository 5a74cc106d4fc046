"""Tokenizer from the model file (GGUF metadata or ``tokenizer.json``), its chat template,
and incremental detokenisation that is right across tokens splitting a UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from chunkserve.model.loader import ModelSource

# llama.cpp's pre-tokenizer regexes for byte-level BPE vocabularies, by ``tokenizer.ggml.pre``.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    if pre == "smollm" or pre in ("starcoder", "refact"):
        # GPT-2 regex plus single digits (llama.cpp's "smollm"/"starcoder" pre-tokenizers).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gguf_bpe_tokenizer(reader: Any) -> HFTokenizer:
    from chunkserve.model.loader import _field

    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = _byte_level_pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=(t == _GGUF_TOKEN_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED)
    ]
    tk.add_tokens(added)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))],
        )
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
        from chunkserve.model.loader import _field

        kind = _field(reader, "tokenizer.ggml.model")
        if kind == "gpt2":
            tk = _gguf_bpe_tokenizer(reader)
        elif kind is not None:
            # SentencePiece-style vocabularies: HF's GGUF converter handles them.
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            tk = hf.backend_tokenizer
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

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
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
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self._CONTEXT :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new stable text (may be empty)."""
        self._ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is left, replacement characters included."""
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens
        )
        full = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
