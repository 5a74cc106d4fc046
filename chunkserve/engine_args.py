"""The engine's command-line flags (vLLM's names) and the ``EngineConfig`` they make:
shared by every command that builds an engine (generate, serve, profile, simulate).

The flags are generated from ``EngineConfig``'s fields (name, type, default, and the
``config.Flag`` in each field's metadata: help, choices, spelling), so a field is written
once. Two flags are not fields: ``--chunked-prefill-size`` (SGLang's spelling of the budget)
and ``--log-level`` (the process's logging)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable

from chunkserve.config import FLAG, EngineConfig, Flag


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512MiB``, ``2GiB``, ``1.5G`` -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None


UNITS: dict[str, Callable[[str], object]] = {"bytes": parse_bytes}


def _value_type(annotation: object, flag: Flag) -> Callable[[str], object] | None:
    """What parses a field's value from its text (None: the text itself)."""
    if flag.unit is not None:
        return UNITS[flag.unit]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    else:
        kinds = [annotation]
    if str in kinds:
        return None
    (kind,) = kinds  # int | None, float, ...: one type besides None
    return kind


def _add_flag(g: argparse._ArgumentGroup, f: dataclasses.Field, annotation: object) -> None:
    flag: Flag = f.metadata[FLAG]
    name = "--" + (flag.name or f.name.replace("_", "-"))
    if annotation is bool:
        if flag.both:
            action: type[argparse.Action] | str = argparse.BooleanOptionalAction
            names = (name,)
        elif f.default:
            action, names = "store_false", ("--no-" + name[2:],)
        else:
            action, names = "store_true", (name,)
        g.add_argument(
            *names, *flag.aliases, dest=f.name, action=action, default=f.default, help=flag.help
        )
        return
    kwargs: dict[str, object] = {}
    value_type = _value_type(annotation, flag)
    if value_type is not None:
        kwargs["type"] = value_type
    if flag.choices is not None:
        kwargs["choices"] = [c for c in flag.choices if c is not None]
    else:  # the flag's name, not the field's, as argparse would show it
        kwargs["metavar"] = name[2:].replace("-", "_").upper()
    g.add_argument(
        name,
        *flag.aliases,
        dest=f.name,
        default=f.default,
        help=flag.help,
        **kwargs,
    )


def _add_chunked_prefill_size(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="SGLang's name for the budget; -1 disables chunked prefill",
    )


def _add_log_level(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


# The flags that are no field, each after the field named.
_AFTER_FIELD = {
    "max_num_batched_tokens": _add_chunked_prefill_size,
    "kv_transfer_host": _add_log_level,
}


def add_engine_args(p: argparse.ArgumentParser, sampler_seed: bool = True) -> None:
    """Engine flags, named as vLLM names them (SGLang's spelling accepted where noted), one
    for each field of ``EngineConfig``, in its order. ``sampler_seed=False``: no ``--seed``
    (the command's own ``--seed``, if any, also seeds the sampler)."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if FLAG in f.metadata and (sampler_seed or f.name != "seed"):
            _add_flag(g, f, hints[f.name])
        if f.name in _AFTER_FIELD:
            _AFTER_FIELD[f.name](g)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if hasattr(args, f.name)
    }
    if args.chunked_prefill_size is not None:
        if args.chunked_prefill_size == -1:
            kwargs["enable_chunked_prefill"] = False
        elif kwargs["max_num_batched_tokens"] not in (None, args.chunked_prefill_size):
            raise ValueError("--chunked-prefill-size and --max-num-batched-tokens disagree")
        else:
            kwargs["max_num_batched_tokens"] = args.chunked_prefill_size
    return EngineConfig(**kwargs)
