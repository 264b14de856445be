#!/usr/bin/env bash
# The one prepared GPU check of issue 23: measurements 1-5 in one go, in under 8 minutes
# on one H100, written to OUT/check.json and OUT/CHECK.md (plus each script's own files).
#
#   benchmarks/gpu/check.sh                 # on the GPU machine; OUT=benchmarks/gpu/check
#   benchmarks/gpu/check.sh --smoke         # tiny shapes, CPU ok (tests/test_gpu_check.py)
#   benchmarks/gpu/check.sh --out DIR [--target DIR --drafter DIR]
#
# 1. lossless: greedy speculative == plain greedy, tiny Llama fp32 + bf16 and a
#    SmolLM2-shape pair (run_all.py correctness), and the embedded pair with real weights
#    in fp32 and bf16 (bench_embedded.py), attention backend `auto`.
# 2. plain decode step, Llama-3.1-8B shape, bf16, batch 1/8/32, context 1k, against
#    the weight-read time at the measured bandwidth (run_all.py decode_bound).
# 3. the embedded pair through the engine, 1/8/32 concurrent: plain, speculative and
#    HF generate tok/s (bench_embedded.py).
# 4. the verify latency curve, tokens 1..1024, and its knee (run_all.py verifier_curve).
# 5. the per-iteration breakdown, speculate / select / verify / other (run_all.py end_to_end).
# Each step has its own time limit, and a step that fails or runs out of time leaves
# the others' results: check_report.py says what is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."

smoke="" out="" target="embedded" drafter="embedded"
while [ $# -gt 0 ]; do
    case "$1" in
        --smoke) smoke="--smoke" ;;
        --out) out="$2"; shift ;;
        --target) target="$2"; shift ;;
        --drafter) drafter="$2"; shift ;;
        *) echo "usage: $0 [--smoke] [--out DIR] [--target DIR] [--drafter DIR]" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$out" ]; then
    if [ -n "$smoke" ]; then out="out/gpu-check-smoke"; else out="benchmarks/gpu/check"; fi
fi
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$out"

# Limits (seconds) that keep the whole check under 8 minutes on one H100; run_all.py
# also stops starting sections past its --budget-s.
run_all_s="${RUN_ALL_S:-300}" embedded_s="${EMBEDDED_S:-150}"
embedded_args=(--backend auto --target "$target" --drafter "$drafter" --concurrency 1,8,32
    --max-tokens 96 --reps 1)
if [ -n "$smoke" ]; then
    embedded_args=(--smoke --backend auto --target "$target" --drafter "$drafter")
fi
start=$(date +%s)
rc=0
echo "== run_all.py (measurements 1, 2, 4, 5)"
timeout "$run_all_s" "$py" benchmarks/gpu/run_all.py $smoke --backend auto \
    --budget-s $((run_all_s - 30)) --out "$out/run_all" || rc=1
echo "== bench_embedded.py (measurements 1, 3)"
timeout "$embedded_s" "$py" benchmarks/gpu/bench_embedded.py "${embedded_args[@]}" \
    --out "$out/embedded" || rc=1
echo "== report"
"$py" benchmarks/gpu/check_report.py --out "$out" --wall-s $(($(date +%s) - start)) || rc=1
exit $rc
