"""Tiny smoke-test client for the peer servers (stdlib only; not the benchmark load generator).

Sends streamed OpenAI ``/v1/completions`` requests (optionally several at once, optionally
staggered) and prints, per request: text chunks received, ``usage`` from the final chunk (if
any), finish_reason, time to first token and total time.

    python benchmarks/peers/smoke_client.py --port 8101 --prompt-ids 200 --max-tokens 32
    python benchmarks/peers/smoke_client.py --port 8102 -n 3 --max-tokens 8 --late 1:0.5
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time


def stream_completion(host: str, port: int, body: dict, timeout: float = 600.0) -> dict:
    """POST one streamed completion and collect its SSE events."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    out = {
        "status": resp.status,
        "chunks": 0,
        "text": "",
        "usage": None,
        "finish_reason": None,
        "ttft_s": None,
        "done": False,
        "t_start": t0,
        "events": 0,
        "extra_keys": set(),
    }
    if resp.status != 200:
        out["error"] = resp.read().decode("utf-8", "replace")
        conn.close()
        return out
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            out["done"] = True
            break
        ev = json.loads(payload)
        out["events"] += 1
        out["extra_keys"].update(
            k for k in ev if k not in ("id", "object", "created", "model", "choices", "usage")
        )
        if ev.get("usage"):
            out["usage"] = ev["usage"]
        for ch in ev.get("choices") or []:
            if ch.get("text"):
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["chunks"] += 1
                out["text"] += ch["text"]
            if ch.get("finish_reason"):
                out["finish_reason"] = ch["finish_reason"]
    out["total_s"] = time.perf_counter() - t0
    out["t_end"] = time.perf_counter()
    conn.close()
    out["extra_keys"] = sorted(out["extra_keys"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("-n", "--num", type=int, default=1, help="concurrent requests")
    ap.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    ap.add_argument(
        "--prompt-ids",
        type=int,
        default=0,
        help="send a token-id list of this length instead of --prompt",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--no-usage", action="store_true")
    ap.add_argument(
        "--late",
        default=None,
        help="IDX:SECONDS - send request IDX (0-based) this many seconds late",
    )
    ap.add_argument("--show-text", action="store_true")
    args = ap.parse_args()

    late_idx, late_s = (-1, 0.0)
    if args.late:
        a, b = args.late.split(":")
        late_idx, late_s = int(a), float(b)

    results: list[dict | None] = [None] * args.num
    t_base = time.perf_counter()

    def worker(i: int) -> None:
        if i == late_idx:
            time.sleep(late_s)
        if args.prompt_ids:
            # deterministic, valid ids in the ordinary-token range; differ per request
            prompt = [(1000 + 37 * k + 11 * i) % 40000 + 100 for k in range(args.prompt_ids)]
        else:
            prompt = args.prompt if args.num == 1 else f"{args.prompt} ({i})"
        body = {
            "model": "peer",
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "ignore_eos": not args.no_ignore_eos,
        }
        if not args.no_usage:
            body["stream_options"] = {"include_usage": True}
        results[i] = stream_completion(args.host, args.port, body)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for i, r in enumerate(results):
        assert r is not None
        if r["status"] != 200:
            print(f"req{i}: HTTP {r['status']} {r.get('error')}")
            continue
        usage = r["usage"] or {}
        print(
            f"req{i}: start=+{r['t_start'] - t_base:.2f}s end=+{r['t_end'] - t_base:.2f}s "
            f"text_chunks={r['chunks']} usage.completion_tokens={usage.get('completion_tokens')} "
            f"usage.prompt_tokens={usage.get('prompt_tokens')} finish={r['finish_reason']} "
            f"ttft={r['ttft_s'] if r['ttft_s'] is None else round(r['ttft_s'], 3)}s "
            f"total={r['total_s']:.3f}s done={r['done']} other_keys={r['extra_keys']}"
        )
        if args.show_text:
            print(f"  text={r['text']!r}")
            if usage:
                print(f"  usage={json.dumps(usage)}")


if __name__ == "__main__":
    main()
