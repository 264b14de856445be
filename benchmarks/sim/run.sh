#!/usr/bin/env bash
# Reproduces benchmarks/sim/RESULTS.md: the simulated AdaServe evaluation on the shipped
# A100 profiles. CPU only; about an hour on 2 busy cores (sweeps run 2 simulations at
# a time). Results land in benchmarks/sim/results/.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=benchmarks/sim/results
SIM=".venv/bin/adaserve simulate"
JOBS=${JOBS:-2}
mkdir -p "$OUT"

# Speed: one 10-minute trace at the paper's highest rate.
[ -f "$OUT/eurosys-600s-rps4.8/summary.json" ] || /usr/bin/time -f "%e s wall" $SIM workloads/adaserve-eurosys.yaml --policy adaserve --rps 4.8 \
  --duration 600 --out "$OUT/eurosys-600s-rps4.8" 2>&1 | tail -8

# Figs. 8-9: every policy across request rates (5-minute traces).
[ -f "$OUT/eurosys-rps/sweep_rps.csv" ] ||
  $SIM workloads/adaserve-eurosys.yaml --sweep rps --jobs "$JOBS" --quiet --out "$OUT/eurosys-rps"
# Figs. 10-11: urgent proportion and SLO scale at 4.0 req/s (3-minute traces, fewer
# policies: the shared 2-core machine allowed no more).
$SIM workloads/adaserve-eurosys.yaml --sweep urgent --jobs "$JOBS" --quiet --duration 180 \
  --values 0.2,0.5,0.8 --policies adaserve,spec-2,cb --out "$OUT/eurosys-urgent"
$SIM workloads/adaserve-eurosys.yaml --sweep slo-scale --jobs "$JOBS" --quiet --duration 180 \
  --values 0.6,1.0,1.4 --policies adaserve,spec-2,cb --out "$OUT/eurosys-slo-scale"
# Qwen2.5-32B TP2.
$SIM workloads/adaserve-eurosys-qwen.yaml --sweep rps --jobs "$JOBS" --quiet --duration 180 \
  --values 2.4,3.2,4.0 --policies adaserve,spec-2,cb --out "$OUT/qwen-rps"
# Figs. 13-14: categories peaking in turn.
for p in adaserve spec-2 cb; do
  $SIM workloads/fluctuating.yaml --policy "$p" --duration 300 --quiet --out "$OUT/fluctuating-$p"
done

.venv/bin/python benchmarks/sim/headline.py "$OUT"/eurosys-rps/sweep_rps.csv \
  "$OUT"/eurosys-urgent/sweep_urgent.csv "$OUT"/eurosys-slo-scale/sweep_slo_scale.csv \
  "$OUT"/qwen-rps/sweep_rps.csv > "$OUT/headline.md"
