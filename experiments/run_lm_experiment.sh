#!/usr/bin/env bash
# The issue-5 experiment on one GPU (docs/performance.md reports it): the 100m preset on the
# default stdlib corpus, dense baseline (L1 = 0) and two L1 coefficients, each for at most
# ${SECONDS_PER_RUN:-160} s, then a short "pallas" run for its tokens/s. Metrics land in
# ${OUT:-runs/lm_experiment}/<run>/ (metrics.jsonl, metrics.png); checkpoints stay in /tmp.
set -uo pipefail
out="${OUT:-runs/lm_experiment}"
common=(--model 100m --batch-size 16 --seq-len 1024 --lr 1e-3 --warmup 100 --eval-every 250
        --eval-batches 8 --ckpt-every 0 --log-every 10)
for coeff in ${COEFFS:-0 0.01 0.03}; do
  run="100m-xla-l1_${coeff}"
  timeout "${SECONDS_PER_RUN:-160}" python3 experiments/train.py "${common[@]}" \
    --implementation xla --l1-coeff "$coeff" --steps "${STEPS:-2000}" --out-dir "/tmp/$run" \
    > "/tmp/$run.log" 2>&1
  echo "$run: exit $?"
  mkdir -p "$out/$run" && cp "/tmp/$run"/metrics.* "/tmp/$run"/config.json "/tmp/$run"/nnz_distribution.json \
    "$out/$run/" 2>/dev/null
  tr '\r' '\n' < "/tmp/$run.log" | grep -v "it/s\]$" | tail -4
done
for impl in ${SPEED_IMPLS-pallas xla}; do
  run="100m-${impl}-speed"
  timeout "${SPEED_SECONDS:-100}" python3 experiments/train.py "${common[@]}" --implementation "$impl" \
    --l1-coeff 0.03 --steps 60 --eval-every 0 --out-dir "/tmp/$run" > "/tmp/$run.log" 2>&1
  echo "$run: exit $?"
  mkdir -p "$out/$run" && cp "/tmp/$run"/metrics.jsonl "$out/$run/" 2>/dev/null
  tr '\r' '\n' < "/tmp/$run.log" | grep -v "it/s\]$" | tail -3
done
