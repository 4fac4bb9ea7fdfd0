#!/usr/bin/env bash
# The parallelism issue's GPU check: Llama 3.2 1B, FSDP (degree = GPUs) + per-block compile +
# bf16 mixed precision, 30 steps at 4096 tokens/sequence, on the embedded corpus with the
# recipe's 32k tokenizer. Prints tokens/s, MFU and peak memory from the run's metrics.
# Usage: bench/gpu_train.sh [NPROC]   (writes runs/bench-1b; record the figures in bench/RESULTS.md)
set -euo pipefail
NPROC=${1:-1}
RUN=runs/bench-1b
.venv/bin/forja train llama3-1b --nproc "$NPROC" --start-over \
  --set run.dir="\"$RUN\"" --set train.steps=30 --set train.micro_batch_size=4 \
  --set train.global_batch_size=$((4 * NPROC * 2)) --set train.val_interval=0 --set train.sample_tokens=0 \
  --set checkpoint.enabled=false --set metrics.interval=5 --set 'metrics.sinks=["console","jsonl"]' \
  --set parallel.compile=true --set parallel.mixed_precision='"bf16"' --set model.attention='"flex"'
.venv/bin/python - "$RUN" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in l]
last = rows[-1]  # the window of steps 26-30: compile and warm-up are behind
print(f"steps {last['step']}: {last['tokens_per_sec']:,.0f} tokens/s, "
      f"{last['tflops']:.1f} TFLOP/s/GPU, MFU {last['mfu'] if last['mfu'] is None else round(100 * last['mfu'], 1)}%, "
      f"peak memory {last.get('mem_peak_gb', float('nan')):.1f} GB, loss {last['loss']:.3f}")
PY
