"""Checks for hf_static_server.py against a running instance (smoke test, not a benchmark).

1. Greedy text from the server (streamed, temperature 0, EOS honoured) equals HF ``generate``
   greedy (``do_sample=False``) for the same prompt, run in this process.
2. The same prompt again, this time in one static batch with two longer prompts (so it is
   left-padded): reports whether the text still matches (bf16 may differ in the last bits).
3. The incremental detokenizer: pushing the ids of text with multi-byte characters one at a time
   gives the same string as decoding them all at once, and never emits U+FFFD.

    python benchmarks/peers/check_hf_greedy.py --port 8102 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_static_server import TextStream, default_model_path, load_model
from smoke_client import stream_completion

PROMPT = "<|im_start|>user\nWrite two sentences about the ocean.<|im_end|>\n<|im_start|>assistant\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model or default_model_path(), args.dtype)
    ok = True

    # 3. detokenizer (cheap, no model forward)
    sample = "Café déjà vu — naïve 😀🚀 世界 ✓ end"
    ids = tok.encode(sample, add_special_tokens=False)
    ts = TextStream(tok)
    pieces = [ts.push(t) for t in ids]
    pieces.append(ts.flush())
    joined = "".join(pieces)
    split_chars = sum(1 for t in ids if "\ufffd" in tok.decode([t]))
    good = joined == tok.decode(ids) and "\ufffd" not in joined
    ok &= good
    print(
        f"[detok] {len(ids)} ids, {split_chars} of them partial UTF-8 on their own; "
        f"incremental == full decode: {good}"
    )

    # 1. greedy vs generate
    prompt_ids = tok.encode(PROMPT, add_special_tokens=True)
    with torch.inference_mode():
        gen = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=args.max_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    gen_ids = gen[0, len(prompt_ids) :].tolist()
    ref = tok.decode(gen_ids, skip_special_tokens=True)
    body = {
        "prompt": prompt_ids,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = stream_completion(args.host, args.port, body)
    same = r["text"] == ref
    ok &= same
    print(
        f"[greedy] generate: {len(gen_ids)} tokens; server: {r['usage']['completion_tokens']} "
        f"tokens, finish={r['finish_reason']}; text equal: {same}"
    )
    print(f"  generate: {ref!r}\n  server:   {r['text']!r}")

    # 2. the same prompt left-padded inside a batch of three
    others = [
        tok.encode("Tell me a long story about a dragon and a knight. " * 6),
        tok.encode("List ten fruits and describe each in detail. " * 4),
    ]
    results: dict[int, dict] = {}

    def send(i: int, p: list[int]) -> None:
        results[i] = stream_completion(
            args.host,
            args.port,
            {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "stream": True},
        )

    threads = [
        threading.Thread(target=send, args=(i, p)) for i, p in enumerate([prompt_ids, *others])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    padded_same = results[0]["text"] == ref
    lens = [len(prompt_ids)] + [len(o) for o in others]
    print(
        f"[greedy, left-padded in a batch of 3 (prompt lens {lens})] "
        f"text equal to generate: {padded_same}"
    )
    if not padded_same:
        print(f"  server:   {results[0]['text']!r}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
