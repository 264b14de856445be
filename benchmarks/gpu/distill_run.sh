#!/usr/bin/env bash
# The embedded drafter's GPU training run, in two device calls (the target travels in
# two halves, see distill_pack.py):
#   MODE=smoke: keep part 1 on the machine, then a short run on the 10-layer truncation
#   MODE=full:  unpack the whole target, generate, train L2/L3/L4, collect into $OUT
# Knobs: GEN_S, TRAIN_S, GEN_BATCH, BATCH_TOKENS, PASSES, LAYERS.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/distill_out}
KEEP=/tmp/distill_w1
GEN_S=${GEN_S:-170}; TRAIN_S=${TRAIN_S:-270}; GEN_BATCH=${GEN_BATCH:-768}
BATCH_TOKENS=${BATCH_TOKENS:-65536}; PASSES=${PASSES:-4}; LAYERS=${LAYERS:-2,3,4}
DEVICE=${DEVICE:-cuda}; HELDOUT=${HELDOUT:-388}
mkdir -p "$OUT"
if [ "${MODE:-full}" = smoke ]; then
  mkdir -p $KEEP && cp .gpu/distill_w1/* $KEEP/
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  $PY -c "import torch, safetensors, tqdm, numpy; print('torch', torch.__version__, torch.cuda.is_available())"
  rm -rf /tmp/t10 /tmp/smoke_work /tmp/smoke_out && mkdir -p /tmp/smoke_work
  cp .gpu/distill_work/prompts.json /tmp/smoke_work/
  $PY benchmarks/gpu/distill_pack.py unpack $KEEP /tmp/t10
  TARGET=/tmp/t10; WORK=/tmp/smoke_work; DOUT=/tmp/smoke_out
else
  [ -f $KEEP/raw.safetensors ] || { echo "part 1 of the target is gone (fresh machine)"; exit 3; }
  rm -rf /tmp/target /tmp/distill_dout
  $PY benchmarks/gpu/distill_pack.py unpack $KEEP .gpu/distill_w2 /tmp/target
  TARGET=/tmp/target; WORK=.gpu/distill_work; DOUT=/tmp/distill_dout
fi
$PY -m adaserve.cli distill --target $TARGET --target-name embedded --out $DOUT --work-dir $WORK \
  --layers $LAYERS --device $DEVICE --time-budget-s $TRAIN_S --gen-time-budget-s $GEN_S \
  --gen-batch $GEN_BATCH --batch-size $BATCH_TOKENS --sample-passes $PASSES --max-heldout $HELDOUT \
  ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v -E '^\s*$' | tee "$OUT/run.log"
$PY benchmarks/gpu/distill_collect.py $DOUT $WORK "$OUT"
[ "${MODE:-full}" = smoke ] && rm -f "$OUT"/*.safetensors  # weights of a truncated target: useless
ls -la "$OUT"
