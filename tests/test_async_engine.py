"""AsyncEngine and the app in-process: a step that raises fails only its requests (HTTP 500)
and the engine goes on serving; aborts free blocks."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from chunkserve.async_engine import AsyncEngine, RequestFailedError
from chunkserve.engine import Engine
from chunkserve.request import SamplingParams
from chunkserve.server.api import build_app
from tests.conftest import assert_no_blocks_in_use

POISON = 7777  # a token id that makes the fake fault fire


@pytest.fixture(scope="module")
def engine() -> Engine:
    eng = Engine(
        dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=64
    )
    real = eng.runner.execute

    def faulty(out):
        if any(POISON in c.request.prompt_token_ids for c in out.chunks):
            raise RuntimeError("injected fault")
        return real(out)

    eng.runner.execute = faulty
    return eng


async def collect(agen):
    return [o async for o in agen]


def test_failing_step_fails_only_its_requests(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0)
            # The step that raises fails the requests in it (here: the poisoned one alone)...
            with pytest.raises(RequestFailedError, match="injected fault"):
                await collect(ae.generate([POISON, 5, 6], params))
            # ...and the engine goes on serving.
            outs = await asyncio.gather(
                *(collect(ae.generate([10 + i, 11, 12], params)) for i in range(3))
            )
            assert all(o[-1].finished and o[-1].finish_reason == "length" for o in outs)
            assert ae.healthy
        finally:
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_abort_by_closing_the_stream(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            agen = ae.generate([20, 21, 22], params)
            async for out in agen:
                if len(out.token_ids) >= 3:
                    break
            await agen.aclose()
            for _ in range(100):
                if not engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
        finally:
            ae.stop()

    asyncio.run(main())
    assert_no_blocks_in_use(engine)


def test_http_500_for_failed_step_then_serves(engine: Engine) -> None:
    app = build_app(AsyncEngine(engine), served_model_name="m")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": [POISON, 1, 2], "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        r = client.post(
            "/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        r = client.post(
            "/v1/completions", json={"prompt": [POISON, 1, 2], "max_tokens": 3, "stream": True}
        )
        assert r.status_code == 200 and '"server_error"' in r.text and "[DONE]" in r.text
        assert client.get("/health").status_code == 200
    assert_no_blocks_in_use(engine)
