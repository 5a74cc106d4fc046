"""``chunkserve <command>``: generate, serve, bench, profile, tune, simulate."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from chunkserve.engine_args import add_engine_args, engine_config_from_args


class Command(NamedTuple):
    """One ``chunkserve`` command. ``setup`` and ``handler`` are ``"module:function"``:
    ``setup(parser)`` adds the command's arguments, ``handler(args)`` runs it and returns the
    exit status. Their modules are imported only when the command is chosen, so listing the
    commands (``chunkserve --help``) imports none of them."""

    name: str
    help: str
    setup: str
    handler: str


COMMANDS: tuple[Command, ...] = (
    Command(
        "generate",
        "generate a completion and stream it to the terminal",
        "chunkserve.entrypoints.cli:_generate_args",
        "chunkserve.entrypoints.cli:_generate",
    ),
    Command(
        "serve",
        "serve the model over an OpenAI-compatible HTTP API",
        "chunkserve.entrypoints.serve:_serve_args",
        "chunkserve.entrypoints.serve:_serve",
    ),
    Command(
        "router",
        "route OpenAI requests to prefill/decode or data-parallel server instances",
        "chunkserve.entrypoints.router:_router_args",
        "chunkserve.entrypoints.router:_router",
    ),
    Command(
        "bench",
        "benchmarks: load generator (serve) and budget sweeps (sweep)",
        "chunkserve.bench.cli:_bench_args",
        "chunkserve.bench.cli:_bench",
    ),
    Command(
        "profile",
        "measure step times on this hardware and fit the cost model",
        "chunkserve.tuning.cli:_profile_args",
        "chunkserve.tuning.cli:_profile",
    ),
    Command(
        "tune",
        "recommend a static --max-num-batched-tokens for an ITL target",
        "chunkserve.tuning.cli:_tune_args",
        "chunkserve.tuning.cli:_tune",
    ),
    Command(
        "simulate",
        "run the real scheduler against a cost model instead of the model",
        "chunkserve.tuning.cli:_simulate_args",
        "chunkserve.tuning.cli:_simulate",
    ),
)


def resolve(target: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (importing its module)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise


# ---- generate ------------------------------------------------------------------------------
def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    add_engine_args(p)
    p.set_defaults(log_level="warning")


def _generate(args: argparse.Namespace) -> int:
    from chunkserve.engine.engine import Engine
    from chunkserve.scheduling.sampling_params import SamplingParams

    engine = Engine(engine_config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
    )
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    if out is not None and out.metrics is not None:
        m = out.metrics
        n = len(out.token_ids)
        tpot = f"{1e3 * m.tpot:.1f} ms" if m.tpot is not None else "n/a"
        print(
            f"[{n} tokens, finish_reason={out.finish_reason}, TTFT {1e3 * (m.ttft or 0):.0f} "
            f"ms, TPOT {tpot}]",
            file=sys.stderr,
        )
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command in ``COMMANDS``. The arguments of ``command`` (of all
    commands when None) are set up; the others have only their name and help."""
    parser = argparse.ArgumentParser(prog="chunkserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if command is None or cmd.name == command:
            resolve(cmd.setup)(p)
        p.set_defaults(handler=cmd.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level parser has no option that takes a value, so the command is the first
    # argument that is not an option ("": none given, no command's arguments are set up).
    chosen = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(chosen).parse_args(argv)
    setup_logging(getattr(args, "log_level", "info"))
    try:
        return resolve(args.handler)(args)
    except ValueError as exc:
        print(f"chunkserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
