"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: every operation, with
data the schema allows and data it does not. No response may be a 5xx, every status and
content type must be one the schema documents, and the server must serve (and hold no KV
blocks) afterwards.

The server runs with a 64-token context, so any request the fuzzer makes valid finishes in
a second or so."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_server import MODEL, Server, assert_alive

# Enough to reach every operation in both modes (each case runs twice when it names a
# model); more examples mostly repeat generation requests the first ones already made.
EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Server]:
    s = Server("--max-model-len", "64", "--kv-cache-memory", "16MiB", "--max-num-seqs", "16")
    yield s
    s.stop()


# What the server promises for any input: no 5xx, only documented statuses and content
# types, bodies that match the documented schema.
CHECKS_RUN = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def fuzz_operation(operation, mode: GenerationMode, base: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case) -> None:
        # The timeout only guards against a hang (a loaded machine answered one in > 60 s).
        case.call_and_validate(base_url=base, checks=CHECKS_RUN, timeout=300)
        if isinstance(case.body, dict) and "model" in case.body:
            # The same body for the served model: past the 404, into validation and
            # generation.
            case.body = {**case.body, "model": MODEL}
            case.call_and_validate(base_url=base, checks=CHECKS_RUN, timeout=300)

    run()


def takes_input(operation) -> bool:
    """Whether the operation has a body or any parameter (path, query, header, cookie)."""
    return len(operation.body) > 0 or any(True for _ in operation.iter_parameters())


def test_api_conforms_to_its_schema_under_fuzzing(fuzz_server: Server) -> None:
    """Every operation of /openapi.json, with data the schema allows and data it does not."""
    schema = schemathesis.openapi.from_url(fuzz_server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /tokenize",
        "POST /detokenize",
        "GET /v1/models",
        "GET /health",
    }
    assert not takes_input(next(op for op in operations if op.path == "/health"))
    assert takes_input(next(op for op in operations if op.path == "/v1/completions"))
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz_operation(op, mode, fuzz_server.base)
            except Unsatisfiable:
                # Only an operation that takes no input at all (GET /health) has nothing to
                # make invalid; one with a body or parameters must be fuzzed negatively too.
                assert mode == GenerationMode.NEGATIVE and not takes_input(op), (
                    f"{op.method.upper()} {op.path} ({mode.value}): no test case generated"
                )
            except Exception as exc:
                raise AssertionError(f"{op.method.upper()} {op.path} ({mode.value})") from exc


def test_server_serves_and_holds_nothing_after_fuzzing(fuzz_server: Server) -> None:
    m = fuzz_server.wait_idle(timeout=60)
    assert m["chunkserve:kv_cache_blocks_used"] == 0
    assert_alive(fuzz_server)
