"""The engine's command line, pinned: every flag of every command that takes the engine's
flags (``generate``, ``serve``, ``profile``, ``simulate``), its ``--no-`` form, what it parses
to (value and type, as ``EngineConfig`` gets it), its default, its errors, and the help a user
reads (``tests/cli_help/<command>.txt``: each option of ``--help`` with its metavar and help
text, in order; argparse's own layout differs between Python versions, so it is not pinned).

The flags are generated from ``EngineConfig``'s fields; this file was written against the
hand-written parser before that, so a generated parser that passes it is the same command
line for users. To accept a deliberate change of the help, rewrite the golden files with
``CHUNKSERVE_UPDATE_CLI_HELP=1`` and review the diff."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import pytest

from chunkserve.config import EngineConfig, SpeculativeConfig
from chunkserve.engine_args import engine_config_from_args
from chunkserve.entrypoints.cli import build_parser

COMMANDS = ("generate", "serve", "profile", "simulate")
HELP_DIR = Path(__file__).parent / "cli_help"
POSITIONALS = {"generate": ["hi"]}


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser(command).parse_args([command, *POSITIONALS.get(command, []), *argv])


def config(command: str, *argv: str) -> EngineConfig:
    return engine_config_from_args(parse(command, *argv))


# The engine group, in order: option strings, whether the flag takes a value, choices.
ENGINE_FLAGS: list[tuple[tuple[str, ...], bool, list[str] | None]] = [
    (("--model",), True, None),
    (("--tokenizer",), True, None),
    (("--revision",), True, None),
    (("--tokenizer-revision",), True, None),
    (("--download-dir",), True, None),
    (("--generation-config",), True, None),
    (("--override-generation-config",), True, None),
    (("--dtype",), True, ["auto", "bfloat16", "float16", "float32"]),
    (("--device",), True, ["auto", "cpu", "cuda"]),
    (("--max-model-len",), True, None),
    (("--block-size",), True, None),
    (("--kv-cache-memory",), True, None),
    (("--max-num-batched-tokens",), True, None),
    (("--chunked-prefill-size",), True, None),
    (("--max-num-seqs",), True, None),
    (("--no-chunked-prefill",), False, None),
    (("--scheduling-policy",), True, ["fcfs", "priority"]),
    (("--prefill-order",), True, ["shortest", "arrival"]),
    (("--enable-prefix-caching", "--no-enable-prefix-caching"), False, None),
    (("--hybrid-kv-cache", "--no-hybrid-kv-cache"), False, None),
    (("--max-num-partial-prefills",), True, None),
    (("--max-long-partial-prefills",), True, None),
    (("--long-prefill-token-threshold",), True, None),
    (("--max-decode-slowdown",), True, None),
    (("--long-step-share",), True, None),
    (("--itl-slo-ms",), True, None),
    (("--cost-profile",), True, None),
    (("--schedule-conservativeness",), True, None),
    (("--seed",), True, None),
    (("--num-threads",), True, None),
    (("--attention-backend",), True, ["auto", "cpu", "torch", "triton"]),
    (("--deterministic",), False, None),
    (("--deterministic-quant-kernel",), True, ["int8", "bf16"]),
    (("--load-format",), True, ["auto", "dummy"]),
    (("--gguf-dequantize",), False, None),
    (("--quantization",), True, ["int8", "int4"]),
    (("--enforce-eager",), False, None),
    (("--no-fused-ops",), False, None),
    (("--speculative-config",), True, None),
    (("--tensor-parallel-size", "--tp"), True, None),
    (("--nnodes",), True, None),
    (("--node-rank",), True, None),
    (("--no-tensor-parallel-shm",), False, None),
    (("--enable-expert-parallel",), False, None),
    (("--disaggregation-mode",), True, ["prefill", "decode"]),
    (("--kv-connector",), True, ["shm", "torch"]),
    (("--kv-transfer-host",), True, None),
    (("--log-level",), True, ["debug", "info", "warning", "error"]),
    (("--decode-log-interval",), True, None),
]

SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'

# Each flag as parsed: argv -> the EngineConfig fields it sets (value and exact type).
PARSED: list[tuple[list[str], dict[str, object]]] = [
    (["--model", "m.gguf"], {"model": "m.gguf"}),
    (["--tokenizer", "tok"], {"tokenizer": "tok"}),
    (["--revision", "v1.0"], {"revision": "v1.0"}),
    (["--tokenizer-revision", "abc"], {"tokenizer_revision": "abc"}),
    (["--download-dir", "/tmp/hf"], {"download_dir": "/tmp/hf"}),
    (["--generation-config", "vllm"], {"generation_config": "vllm"}),
    (
        ["--override-generation-config", '{"temperature": 0.5}'],
        {"override_generation_config": {"temperature": 0.5}},
    ),
    (["--dtype", "float32"], {"dtype": "float32"}),
    (["--device", "cpu"], {"device": "cpu"}),
    (["--max-model-len", "512"], {"max_model_len": 512}),
    (["--block-size", "32"], {"block_size": 32}),
    (["--kv-cache-memory", "2GiB"], {"kv_cache_memory": 2 << 30}),
    (["--kv-cache-memory", "512MiB"], {"kv_cache_memory": 512 << 20}),
    (["--kv-cache-memory", "1.5G"], {"kv_cache_memory": 3 << 29}),
    (["--kv-cache-memory", "1000"], {"kv_cache_memory": 1000}),
    (["--kv-cache-memory", "4k"], {"kv_cache_memory": 4096}),
    (["--max-num-batched-tokens", "256"], {"max_num_batched_tokens": 256}),
    (["--chunked-prefill-size", "128"], {"max_num_batched_tokens": 128}),
    (
        ["--chunked-prefill-size", "128", "--max-num-batched-tokens", "128"],
        {"max_num_batched_tokens": 128},
    ),
    (["--chunked-prefill-size", "-1"], {"enable_chunked_prefill": False}),
    (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--no-chunked-prefill"], {"enable_chunked_prefill": False}),
    (["--scheduling-policy", "priority"], {"scheduling_policy": "priority"}),
    (["--prefill-order", "arrival"], {"prefill_order": "arrival"}),
    (["--no-enable-prefix-caching"], {"enable_prefix_caching": False}),
    (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    (["--no-hybrid-kv-cache"], {"hybrid_kv_cache": False}),
    (["--max-num-partial-prefills", "2"], {"max_num_partial_prefills": 2}),
    (["--max-long-partial-prefills", "3"], {"max_long_partial_prefills": 3}),
    (["--long-prefill-token-threshold", "100"], {"long_prefill_token_threshold": 100}),
    (["--max-decode-slowdown", "3"], {"max_decode_slowdown": 3.0}),
    (["--long-step-share", "0.01"], {"long_step_share": 0.01}),
    (["--itl-slo-ms", "50"], {"itl_slo_ms": 50.0}),
    (["--cost-profile", "p.json"], {"cost_profile": "p.json"}),
    (["--schedule-conservativeness", "0.5"], {"schedule_conservativeness": 0.5}),
    (["--seed", "7"], {"seed": 7}),
    (["--num-threads", "2"], {"num_threads": 2}),
    (["--attention-backend", "torch"], {"attention_backend": "torch"}),
    (["--deterministic"], {"deterministic": True}),
    (
        ["--deterministic", "--deterministic-quant-kernel", "bf16"],
        {"deterministic": True, "deterministic_quant_kernel": "bf16"},
    ),
    (["--load-format", "dummy"], {"load_format": "dummy"}),
    (["--gguf-dequantize"], {"gguf_dequantize": True}),
    (["--quantization", "int8"], {"quantization": "int8"}),
    (["--quantization", "int4"], {"quantization": "int4"}),
    (["--enforce-eager"], {"enforce_eager": True}),
    (["--no-fused-ops"], {"fused_ops": False}),
    (["--speculative-config", SPEC], {"speculative_config": SpeculativeConfig.parse(SPEC)}),
    (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}),
    (["--tp", "2"], {"tensor_parallel_size": 2}),
    (["--tp", "2", "--nnodes", "2"], {"tensor_parallel_size": 2, "nnodes": 2}),
    (
        ["--tp", "2", "--nnodes", "2", "--node-rank", "1"],
        {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1},
    ),
    (["--no-tensor-parallel-shm"], {"tensor_parallel_shm": False}),
    (["--enable-expert-parallel"], {"enable_expert_parallel": True}),
    (["--disaggregation-mode", "prefill"], {"disaggregation_mode": "prefill"}),
    (["--kv-connector", "torch"], {"kv_connector": "torch"}),
    (["--kv-transfer-host", "10.0.0.1"], {"kv_transfer_host": "10.0.0.1"}),
    (["--decode-log-interval", "5"], {"log_stats_interval": 5}),
]

# A bad value: the exit status and the line argparse prints.
ERRORS: list[tuple[list[str], str]] = [
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size in bytes: 'lots'"),
    (["--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
    (["--max-decode-slowdown", "x"], "argument --max-decode-slowdown: invalid float value: 'x'"),
    (["--tp", "two"], "argument --tensor-parallel-size/--tp: invalid int value: 'two'"),
    (["--no-fused-ops=1"], "argument --no-fused-ops: ignored explicit argument '1'"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--quantization", "fp8"], "argument --quantization: invalid choice: 'fp8'"),
]


def engine_group(command: str) -> list[argparse.Action]:
    (group,) = (g for g in subparser(command)._action_groups if g.title == "engine")
    return group._group_actions


@pytest.mark.parametrize("command", COMMANDS)
def test_engine_flags_names_and_forms(command: str) -> None:
    expected = [f for f in ENGINE_FLAGS if command != "simulate" or f[0] != ("--seed",)]
    got = [
        (tuple(a.option_strings), a.nargs != 0, None if a.choices is None else list(a.choices))
        for a in engine_group(command)
    ]
    assert got == expected


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_are_engine_config_defaults(command: str) -> None:
    parsed = config(command)
    assert parsed == EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert type(getattr(parsed, f.name)) is type(getattr(EngineConfig(), f.name)), f.name
    args = parse(command)
    assert args.log_level == ("info" if command == "serve" else "warning")


def test_every_field_has_a_flag() -> None:
    covered = {name for _, fields in PARSED for name in fields}
    assert covered == {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("argv", "fields"), PARSED, ids=[" ".join(a) for a, _ in PARSED])
def test_flag_as_parsed(command: str, argv: list[str], fields: dict[str, object]) -> None:
    if command == "simulate" and argv[0] == "--seed":
        assert parse(command, *argv).seed == 7  # the workload's seed, also the sampler's
    parsed = config(command, *argv)
    assert parsed == EngineConfig(**fields)
    for name, value in fields.items():
        assert type(getattr(parsed, name)) is type(value), name


@pytest.mark.parametrize("command", ["serve", "simulate"])
@pytest.mark.parametrize(("argv", "message"), ERRORS, ids=[" ".join(a) for a, _ in ERRORS])
def test_bad_values(command, argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(command, *argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_chunked_prefill_size_disagreeing_with_the_budget() -> None:
    with pytest.raises(ValueError, match="--chunked-prefill-size and --max-num-batched-tokens"):
        config("serve", "--chunked-prefill-size", "128", "--max-num-batched-tokens", "256")


def test_log_level_flag() -> None:
    assert parse("serve", "--log-level", "debug").log_level == "debug"


def help_lines(command: str) -> str:
    """Each option as ``--help`` lists it (its forms, the metavar of a value, its help),
    in order, one per line."""
    lines = []
    for action in subparser(command)._actions:
        names = ", ".join(action.option_strings)
        if action.nargs == 0 or not action.option_strings:
            shown = names or action.dest
        elif action.metavar is not None:  # argparse's order: metavar, choices, dest
            shown = f"{names} {action.metavar}"
        elif action.choices is not None:
            shown = f"{names} {{{','.join(map(str, action.choices))}}}"
        else:
            shown = f"{names} {action.dest.upper()}"
        lines.append(f"{shown}: {action.help or ''}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_text(command: str) -> None:
    text = help_lines(command)
    path = HELP_DIR / f"{command}.txt"
    if os.environ.get("CHUNKSERVE_UPDATE_CLI_HELP"):
        path.write_text(text)
    assert text == path.read_text()


def test_serve_flags_beside_the_engine() -> None:
    """The server's own flags are unchanged too (names and defaults)."""
    args = vars(parse("serve"))
    engine = {a.dest for a in engine_group("serve")}
    own = {k: v for k, v in args.items() if k not in engine and k not in ("command", "handler")}
    assert json.loads(json.dumps(own)) == {
        "host": "127.0.0.1",
        "port": 8000,
        "served_model_name": None,
        "api_key": os.environ.get("CHUNKSERVE_API_KEY"),
        "shutdown_timeout": 30.0,
        "request_timeout": None,
        "max_waiting_requests": None,
        "tool_call_parser": "auto",
        "reasoning_parser": "auto",
        "max_request_body_bytes": 32 << 20,
        "core_process": True,
        "data_parallel_size": 1,
        "watchdog_timeout": None,
    }
