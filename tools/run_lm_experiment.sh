#!/usr/bin/env bash
# The L1-sweep experiment on one GPU (the numbers in docs/performance.md): the 100m preset on the
# default stdlib corpus, dense baseline (L1 = 0) and two L1 coefficients, each for at most
# ${SECONDS_PER_RUN:-160} s, then a short "pallas" run for its tokens/s. Metrics land in
# ${OUT:-runs/lm_experiment}/<run>/ (metrics.jsonl, metrics.png); the runs' own folders (with
# their checkpoints) and logs stay in ${WORK:-runs/lm_experiment_work}.
set -uo pipefail
out="${OUT:-runs/lm_experiment}"
work="${WORK:-runs/lm_experiment_work}"
mkdir -p "$work"
common=(--model 100m --batch-size 16 --seq-len 1024 --lr 1e-3 --warmup 100 --eval-every 250
        --eval-batches 8 --ckpt-every 0 --log-every 10)
for coeff in ${COEFFS:-0 0.01 0.03}; do
  run="100m-xla-l1_${coeff}"
  timeout "${SECONDS_PER_RUN:-160}" python3 experiments/train.py "${common[@]}" \
    --implementation xla --l1-coeff "$coeff" --steps "${STEPS:-2000}" --out-dir "$work/$run" \
    > "$work/$run.log" 2>&1
  echo "$run: exit $?"
  mkdir -p "$out/$run" && cp "$work/$run"/metrics.* "$work/$run"/config.json "$work/$run"/nnz_distribution.json \
    "$out/$run/" 2>/dev/null
  tr '\r' '\n' < "$work/$run.log" | grep -v "it/s\]$" | tail -4
done
for impl in ${SPEED_IMPLS-pallas xla}; do
  run="100m-${impl}-speed"
  timeout "${SPEED_SECONDS:-100}" python3 experiments/train.py "${common[@]}" --implementation "$impl" \
    --l1-coeff 0.03 --steps 60 --eval-every 0 --out-dir "$work/$run" > "$work/$run.log" 2>&1
  echo "$run: exit $?"
  mkdir -p "$out/$run" && cp "$work/$run"/metrics.jsonl "$out/$run/" 2>/dev/null
  tr '\r' '\n' < "$work/$run.log" | grep -v "it/s\]$" | tail -3
done
