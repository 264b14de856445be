#!/usr/bin/env bash
# The embedded drafter's GPU training run. The target travels in three parts
# (distill_pack.py pack ... --split-layers 0,15 into .gpu/target1..3), one part per
# device call: each call keeps what it carried in $KEEP, which lasts while the machine
# stays warm (the next call within its idle window).
#   MODE=stash: keep the carried parts and stop
#   MODE=smoke: a short run on the truncated target that the parts kept so far make
#   MODE=full:  every part kept: generate, train L2/L3/L4, collect into $OUT
# Knobs: GEN_S, TRAIN_S, GEN_BATCH, BATCH_TOKENS, PASSES, LAYERS, NPARTS, EXTRA.
# KEEP_WORK=1 keeps the last call's work dir (its generated data and checkpoint), so a
# run longer than one device call goes on in the next one: EXTRA=--resume there, and
# TRAIN_S counts the training time of both calls.
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
OUT=${OUT:-/tmp/distill_out}
KEEP=${KEEP:-/tmp/distill_keep}
GEN_S=${GEN_S:-170}; TRAIN_S=${TRAIN_S:-270}; GEN_BATCH=${GEN_BATCH:-768}
BATCH_TOKENS=${BATCH_TOKENS:-65536}; PASSES=${PASSES:-4}; LAYERS=${LAYERS:-2,3,4}
DEVICE=${DEVICE:-cuda}; HELDOUT=${HELDOUT:-385}; NPARTS=${NPARTS:-3}
MODE=${MODE:-full}
mkdir -p "$OUT" $KEEP
for d in .gpu/target[0-9]*; do
  [ -d "$d" ] || continue
  rm -rf "$KEEP/$(basename "$d")" && cp -r "$d" $KEEP/
done
[ -f .gpu/distill_work/prompts.json ] && cp .gpu/distill_work/prompts.json $KEEP/
echo "kept: $(ls $KEEP | tr '\n' ' ')"
[ "$MODE" = stash ] && exit 0
PARTS=$(ls -d $KEEP/target[0-9]* | sort)
if [ "${KEEP_WORK:-0}" = 1 ] && [ -d /tmp/distill_work ]; then
  echo "kept work dir: $(ls /tmp/distill_work | tr '\n' ' ')"
  rm -rf /tmp/distill_target /tmp/distill_dout
else
  rm -rf /tmp/distill_target /tmp/distill_work /tmp/distill_dout && mkdir -p /tmp/distill_work
  cp $KEEP/prompts.json /tmp/distill_work/
fi
if [ "$MODE" = full ] && [ "$(echo "$PARTS" | wc -l)" -lt "$NPARTS" ]; then
  echo "only $(echo "$PARTS" | wc -l) of $NPARTS target parts are kept (a fresh machine?)"; exit 3
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L || true
$PY benchmarks/gpu/distill_pack.py unpack $PARTS /tmp/distill_target
$PY -m adaserve.cli distill --target /tmp/distill_target --target-name embedded --out /tmp/distill_dout \
  --work-dir /tmp/distill_work --layers $LAYERS --device $DEVICE --time-budget-s $TRAIN_S \
  --gen-time-budget-s $GEN_S --gen-batch $GEN_BATCH --batch-size $BATCH_TOKENS --sample-passes $PASSES \
  --max-heldout $HELDOUT ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep --line-buffered -v -E '^\s*$' | tee "$OUT/run.log"
$PY benchmarks/gpu/distill_collect.py /tmp/distill_dout /tmp/distill_work "$OUT"
[ "$MODE" = smoke ] && rm -f "$OUT"/*.safetensors  # weights trained on a truncated target: useless
ls -la "$OUT"
