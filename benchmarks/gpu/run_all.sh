#!/usr/bin/env bash
# The GPU benchmark suite, run from the repository root on a CUDA machine:
#
#     bash benchmarks/gpu/run_all.sh [OUT_DIR]          # default benchmarks/results/gpu
#
# 1. ceilings.py     copy bandwidth + bf16 matmul rate  -> OUT_DIR/ceilings.json
# 2. decode_floor.py decode step time vs the bandwidth floor -> OUT_DIR/decode_floor.json
# 3. prefill.py      prefill TFLOP/s per chunk size     -> OUT_DIR/prefill.json, prefill.png
#
# Steps 2 and 3 read the ceilings from step 1 (each measures its own if that file is missing).
# Every step has a time limit and may fail without stopping the others; each script rewrites its
# JSON after every row, so a step cut off keeps what it finished. Expected total on an H100:
# about 3 minutes; the limits add up to 6.5. Environment: PYTHON (default .venv/bin/python
# when present, else python3), MODEL_ROOT (default .gpu/models; written by model_dirs.py when
# missing, which needs the embedded GGUF), EXTRA (flags for all three steps), DECODE_EXTRA and
# PREFILL_EXTRA (flags for one step). CPU smoke test of the driver itself:
#
#     MODEL_ROOT=/tmp/gm EXTRA="--device cpu --quick" \
#     DECODE_EXTRA="--models smollm2-135m --batch-sizes 1,2 --context-len 64" \
#     PREFILL_EXTRA="--models smollm2-135m" bash benchmarks/gpu/run_all.sh /tmp/gpu_smoke
set -u
cd "$(dirname "$0")/../.."
OUT="${1:-benchmarks/results/gpu}"
MODEL_ROOT="${MODEL_ROOT:-.gpu/models}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
EXTRA="${EXTRA:-}"
DECODE_EXTRA="${DECODE_EXTRA:-}"
PREFILL_EXTRA="${PREFILL_EXTRA:-}"
mkdir -p "$OUT"
status=()

step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    status+=("$name: rc=$rc, $((SECONDS - t0)) s")
    echo "=== $name done: rc=$rc in $((SECONDS - t0)) s"
    return $rc
}

nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem \
    --format=csv 2>/dev/null || true

if [ ! -f "$MODEL_ROOT/llama3-8b/config.json" ] || [ ! -f "$MODEL_ROOT/smollm2-135m/config.json" ]
then
    step model_dirs 60 "$PYTHON" benchmarks/gpu/model_dirs.py "$MODEL_ROOT" || true
fi

# shellcheck disable=SC2086  # the *EXTRA variables are lists of flags
step ceilings 60 "$PYTHON" benchmarks/gpu/ceilings.py --out "$OUT" $EXTRA || true

# shellcheck disable=SC2086
step decode_floor 210 "$PYTHON" benchmarks/gpu/decode_floor.py --model-root "$MODEL_ROOT" \
    --ceilings "$OUT/ceilings.json" --out "$OUT" $EXTRA $DECODE_EXTRA || true

# shellcheck disable=SC2086
step prefill 120 "$PYTHON" benchmarks/gpu/prefill.py --model-root "$MODEL_ROOT" \
    --ceilings "$OUT/ceilings.json" --out "$OUT" $EXTRA $PREFILL_EXTRA || true

echo
echo "=== summary ($OUT)"
printf '  %s\n' "${status[@]}"
"$PYTHON" - "$OUT" <<'PY' || true
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    path = out / name
    if not path.exists():
        print(f"  {name}: missing")
        return None
    return json.loads(path.read_text())


c = load("ceilings.json")
if c:
    cl = c["ceilings"]
    print(
        f"  {c['meta']['machine']}: copy {cl['copy_bandwidth_gbs']:.0f} GB/s, "
        f"matmul {cl['matmul_tflops']:.3g} TFLOP/s ({cl['matmul']['dtype']})"
    )
d = load("decode_floor.json")
if d:
    for r in d["rows"]:
        if r["batch"] == 64 or "error" in r:
            what = r.get("error") or (
                f"{1e3 * r['forward_s']:.2f} ms, {r['ratio_forward']:.2f}x floor"
            )
            print(f"  decode {r['model']} {r['config']} batch {r['batch']}: {what}")
    print("  " + d["meta"].get("target", "decode target: run did not finish"))
p = load("prefill.json")
if p:
    for r in p["rows"]:
        if r["tokens"] in (2048, 2049) or "error" in r:
            what = r.get("error") or (
                f"{r['tflops']:.0f} TFLOP/s, {100 * r['matmul_fraction']:.0f}% of matmul"
            )
            print(f"  prefill {r['model']} {r['tokens']}: {what}")
    print("  " + p["meta"].get("target", "prefill target: run did not finish"))
PY
