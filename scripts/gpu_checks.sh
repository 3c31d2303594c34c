#!/bin/bash
# The checks only a GPU can run, as one call of a lent GPU machine (~4 min on an H100 or H200):
#   bash scripts/gpu_checks.sh            # writes what it measured to $OUT (default runs/gpu_checks/out; runs under runs/gpu_checks)
# 1. the CUDA cases of the tests, failures in full (the tolerance log: scripts/tolerances.py report);
# 2. our runtime on one GPU, the rows of benchmarks/data/gpu/fivefold-<gpu>.tsv (step ms, peak MiB);
# 3. the MoE row under --profile: the kernel trace to split its time (benchmarks/RESULTS.md, "fivefold on one GPU");
# 4. a resumed run on the GPU (its optimizer state back on the device);
# 5. the README's demo on a machine with fewer GPUs than its 4 ranks (cluster.device auto: the CPU);
# (the CPU suite on another torch, e.g. the GPU machine's 2.11, runs without a GPU: scripts/test_on_torch.sh)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD RUNS=runs/gpu_checks OUT=${OUT:-runs/gpu_checks/out}
mkdir -p "$OUT"
step() { echo; echo "=== $1 ($(date +%T))"; }
quiet() { tr '\r' '\n' | grep -v "^train:" | tail -"${1:-8}"; }
step facts
nvidia-smi -L; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,clocks.max.mem,memory.total --format=csv; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
step "CUDA test cases"
FIVEFOLD_TOL_LOG=$OUT/tol.jsonl timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore -rfE --tb=short \
  tests/test_attention_backend.py tests/test_moe.py -k "cuda or grouped" 2>&1 | tail -60
step "our runtime on one GPU (benchmarks/data/gpu)"
D=benchmarks/data/gpu
for n in 16 8 4; do
  timeout 60 python3 -m fivefold train $D/llama1b.yaml --out $RUNS/l$n --num-layers $n --train-iters 8 2>&1 | quiet 6 | head -3
  cp $RUNS/l$n/metrics.jsonl "$OUT/llama1b-${n}L.jsonl"
done
timeout 120 python3 -m fivefold train $D/moe.yaml --out $RUNS/moe --train-iters 12 --profile 2>&1 | quiet 6 | head -3
cp $RUNS/moe/metrics.jsonl "$OUT/moe.jsonl"; gzip -c $RUNS/moe/profile/rank-0.pt.trace.json > "$OUT/moe_trace.json.gz"
python3 scripts/trace_launches.py $RUNS/moe/profile/rank-0.pt.trace.json  # launches by layer, syncs, the optimizer
step "resume on the GPU (fused AdamW keeps its step count there): 4 steps, then 2 more from step 4's checkpoint"
timeout 60 python3 -m fivefold train $D/llama1b.yaml --out $RUNS/res --num-layers 2 --train-iters 4 --save-interval 4 2>&1 | quiet 3
timeout 60 python3 -m fivefold train $D/llama1b.yaml --out $RUNS/res2 --num-layers 2 --train-iters 6 --load $RUNS/res/checkpoints 2>&1 | quiet 3
step "demo, 4 ranks (auto: one GPU is too few)"
timeout 60 python3 -m fivefold train examples/demo.yaml --out $RUNS/demo --train-iters 3 2>&1 | quiet 8
step done
