"""Models named by a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``), found through
``huggingface_hub``: the local HF cache first, then a download of only the files we load,
where the network allows it.

- The cache is ``download_dir`` if given (vLLM's ``--download-dir``), else ``HF_HUB_CACHE``,
  else ``HF_HOME/hub``, else huggingface_hub's default: read from the environment at each
  call (a process that sets them after import is honoured).
- ``HF_HUB_OFFLINE=1``: the cache only, no network attempt.
- ``revision``: a branch, a tag or a commit (default ``main``).
- ``repo_id:QUANT`` names one GGUF file in the repository (``*QUANT.gguf``; the quant type as
  llama.cpp writes it in file names, e.g. ``Q4_K_M``), as vLLM's GGUF syntax does.

A local path that exists always wins over a hub id (``loader.resolve_model`` checks it
first); whatever cannot be found is a ``ValueError`` naming the id, the revision and the
cache it looked in.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# What a model directory needs of a repository: weights in safetensors (with their index),
# the config, the tokenizer and the generation defaults. Never *.bin, *.pt, other GGUFs.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
_QUANT = re.compile(r"^[A-Za-z0-9_]+$")
_TRUE = ("1", "on", "yes", "true")


def is_repo_id(name: str) -> bool:
    """``org/name`` (or ``org/name:QUANT``): the shape of a hub id. A bare ``name`` is taken
    for a local path (a mistyped file name should not send anyone to the network)."""
    repo, _ = split_gguf_quant(name)
    return "/" in repo and bool(_REPO_ID.match(repo)) and not repo.endswith(".gguf")


def split_gguf_quant(name: str) -> tuple[str, str | None]:
    """``org/name:Q4_K_M`` -> (``org/name``, ``Q4_K_M``); no colon -> (name, None)."""
    repo, sep, quant = name.partition(":")
    if not sep:
        return name, None
    return repo, quant


def offline() -> bool:
    """``HF_HUB_OFFLINE`` set (now, or when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """Where hub files live: ``download_dir``, ``HF_HUB_CACHE``, ``HF_HOME/hub``, or
    huggingface_hub's default (``~/.cache/huggingface/hub``)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _has_model(path: Path, quant: str | None) -> bool:
    """The cached snapshot holds what we load: the one GGUF, or config.json with every shard
    its index names (an interrupted download lacks some), or with a *.safetensors."""
    if quant is not None:
        return len(_gguf_matches(path, quant)) == 1
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        return all((path / name).is_file() for name in shards)
    return any(path.glob("*.safetensors"))


def _gguf_matches(path: Path, quant: str) -> list[Path]:
    q = quant.lower()
    return sorted(p for p in path.glob("*.gguf") if p.stem.lower().endswith(q))


def _has_tokenizer(path: Path, quant: str | None) -> bool:
    return (path / "tokenizer.json").is_file()


def _where(repo_id: str, revision: str | None, cache: Path) -> str:
    return f"{repo_id!r} (revision {revision or 'main'!r}, cache {str(cache)!r})"


def snapshot(
    name: str,
    *,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    field: str = "model",
    tokenizer: bool = False,
) -> Path:
    """The local folder holding hub model ``name`` at ``revision``: from the cache, else
    downloaded (only ``MODEL_FILES``, or ``TOKENIZER_FILES`` with ``tokenizer``, or the one
    GGUF that ``:QUANT`` names). ``ValueError`` naming ``field`` and the id when neither
    works. For a GGUF, the file's path is ``gguf_file(folder, quant)``."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import (  # also in huggingface_hub.errors since 0.24
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover (a dependency)
        raise ValueError(
            f"{field}: {name!r} is not a local path, and huggingface_hub (needed for hub "
            f"ids) is not installed"
        ) from None
    repo_id, quant = split_gguf_quant(name)
    if quant is not None and (tokenizer or not _QUANT.match(quant)):
        raise ValueError(
            f"{field}: {name!r}: a ':QUANT' suffix names a GGUF file of a model repository "
            f"(letters, digits and '_', e.g. ':Q4_K_M')"
        )
    cache = cache_dir(download_dir)
    complete = _has_tokenizer if tokenizer else _has_model
    if quant is not None:
        patterns = [f"*{quant}.gguf", f"*{quant.lower()}.gguf", f"*{quant.upper()}.gguf"]
    else:
        patterns = list(TOKENIZER_FILES if tokenizer else MODEL_FILES)
    where = _where(repo_id, revision, cache)
    cached_but_incomplete = False
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache),
                local_files_only=True,
                allow_patterns=patterns,
            )
        )
        if complete(path, quant):
            return path
        cached_but_incomplete = True
    except HFValidationError as exc:
        raise ValueError(f"{field}: {name!r} is not a valid hub id ({exc})") from None
    except (LocalEntryNotFoundError, OSError):
        pass
    what = "config.json and every safetensors shard" if not tokenizer else "tokenizer.json"
    if quant is not None:
        what = f"exactly one *{quant}.gguf file"
    if offline():
        state = (
            f"the cache's copy of {where} lacks {what}"
            if cached_but_incomplete
            else f"the cache has no copy of {where}"
        )
        raise ValueError(
            f"{field}: {name!r} is neither a local path nor in the HF cache: {state}, and "
            f"HF_HUB_OFFLINE is set (no download tried)"
        )
    try:
        path = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=str(cache), allow_patterns=patterns
            )
        )
    except RevisionNotFoundError:
        raise ValueError(
            f"{field}: the hub has no revision {revision!r} of {repo_id!r}; cache "
            f"{str(cache)!r} has none either"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ValueError(
            f"{field}: {name!r} is neither a local path nor a model in the HF cache of "
            f"{where}, and the hub refused it ({type(exc).__name__}: not found, private or "
            f"gated: log in with `hf auth login`)"
        ) from None
    except Exception as exc:  # no network, a proxy, a server error: say so, with the id
        raise ValueError(
            f"{field}: {name!r} is neither a local path nor in the HF cache of {where}, and "
            f"the hub could not be reached ({type(exc).__name__}: {exc}); set "
            f"HF_HUB_OFFLINE=1 to use the cache only"
        ) from None
    if not complete(path, quant):
        raise ValueError(f"{field}: {where} has no {what} on the hub")
    return path


def gguf_file(folder: Path, quant: str, field: str = "model") -> Path:
    """The one GGUF in ``folder`` whose name ends in ``quant`` (case-insensitive)."""
    found = _gguf_matches(folder, quant)
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(
            f"{field}: {str(folder)!r} needs exactly one *{quant}.gguf file (found: {names})"
        )
    return found[0]


def resolve_tokenizer(
    tokenizer: str | None,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
) -> str | None:
    """``--tokenizer``: a local directory as it is, a hub id as its cached (or downloaded)
    folder; None stays None (the model's own tokenizer)."""
    if tokenizer is None or Path(tokenizer).expanduser().exists() or not is_repo_id(tokenizer):
        return tokenizer
    return str(
        snapshot(
            tokenizer,
            revision=revision,
            download_dir=download_dir,
            field="tokenizer",
            tokenizer=True,
        )
    )
