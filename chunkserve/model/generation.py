"""A model's ``generation_config.json``: its EOS ids, and the default sampling parameters
requests get where they leave a field unset (vLLM's ``--generation-config``):

- ``auto``: the model's own file (an HF directory or a hub snapshot; a GGUF has none);
- ``vllm``: none, the engine's defaults;
- a folder: the ``generation_config.json`` in it.

``override_generation_config`` is merged over them (alone with ``vllm``). As in vLLM's
server, a ``max_new_tokens`` of a folder's file, or of ``override_generation_config`` (with
``auto`` or ``vllm``), is also a limit on every request's ``max_tokens``
(``max_tokens_cap``); the model's own file only gives the default. Of the file, the
fields ``config.GENERATION_DEFAULT_KEYS`` count, as vLLM reads them: a value equal to
transformers' ``GenerationConfig`` default is no default (vLLM takes the file's difference
from those, so ``top_k: 50`` is dropped), ``do_sample`` is ignored, and ``max_new_tokens``
becomes ``max_tokens``.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from chunkserve.config import GENERATION_DEFAULT_KEYS, EngineConfig
from chunkserve.model.source import ModelSource

FILE = "generation_config.json"
# transformers' GenerationConfig defaults of those fields: a file's value equal to one of
# them is not a default of ours (vLLM reads ``to_diff_dict()``).
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def read_generation_config(folder: Path, field: str = "generation_config") -> dict[str, Any]:
    """The folder's ``generation_config.json`` as a dict ({} if it has none)."""
    file = folder / FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{field}: cannot read {str(file)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {str(file)!r} is not a JSON object")
    return data


def eos_ids_of(data: dict[str, Any]) -> list[int]:
    """``eos_token_id`` of a config dict: one id or a list (Llama 3 lists three)."""
    eos = data.get("eos_token_id")
    if eos is None:
        return []
    values = eos if isinstance(eos, list) else [eos]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def model_eos_ids(source: ModelSource) -> list[int]:
    """EOS ids the model's folder lists in ``generation_config.json`` and ``config.json``
    (whatever tokenizer serves it)."""
    if source.kind != "hf":
        return []
    ids = eos_ids_of(read_generation_config(source.path, "model"))
    config = source.path / "config.json"
    if config.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError):  # the loader reports it
            ids += eos_ids_of(json.loads(config.read_text()))
    return ids


def sampling_defaults(config: EngineConfig, source: ModelSource) -> dict[str, Any]:
    """Requests' default sampling parameters (``SamplingParams`` field -> value), checked
    with the sampling parameters' own rules: ``ValueError`` naming ``generation_config`` (or
    ``override_generation_config``) and the field."""
    from chunkserve.scheduling.sampling_params import SamplingParams

    mode = config.generation_config
    if mode == "vllm":
        raw: dict[str, Any] = {}
    elif mode == "auto":
        raw = read_generation_config(source.path) if source.kind == "hf" else {}
    else:
        folder = Path(mode).expanduser()
        if not folder.is_dir() or not (folder / FILE).is_file():
            raise ValueError(
                f"generation_config: {mode!r} is neither 'auto', 'vllm' nor a folder holding {FILE}"
            )
        raw = read_generation_config(folder)
    found = {
        k: raw[k]
        for k in GENERATION_DEFAULT_KEYS
        if raw.get(k) is not None and raw[k] != _TRANSFORMERS_DEFAULTS.get(k)
    }
    out: dict[str, Any] = {}
    for origin, values in (
        ("generation_config", found),
        ("override_generation_config", config.override_generation_config or {}),
    ):
        for key, value in values.items():
            name = "max_tokens" if key == "max_new_tokens" else key
            if value is None:
                out.pop(name, None)
                continue
            try:
                SamplingParams(**{name: value})
            except ValueError as exc:
                raise ValueError(f"{origin}.{key}: {exc}") from None
            out[name] = value
    return out


def max_tokens_cap(config: EngineConfig, defaults: dict[str, Any]) -> int | None:
    """The limit on every request's ``max_tokens`` that vLLM's server derives from the
    generation config: a folder's ``max_new_tokens`` (after the overrides), else the
    ``max_new_tokens`` of ``override_generation_config``; None: no limit."""
    if config.generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (config.override_generation_config or {}).get("max_new_tokens")
