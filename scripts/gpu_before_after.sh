#!/bin/bash
# Our runtime's one-GPU rows before and after a change, on one machine in one call of a lent GPU (timings
# compare only on the same machine; ~1 min a row pair on an H100):
#   git archive REV fivefold | tar -x -C runs/base      # here, first: the package as it was (runs/ is ignored)
#   bash scripts/gpu_before_after.sh runs/base [ROW ...]  # on the GPU, carrying runs/base
# ROW: moe, moe-gc (--manual-gc), 4L, 4L-fp16, 16L (default: moe 4L). Each row is trained STEPS steps (default 20) with the package
# in runs/base, then with this tree's; printed: the median step time of the steps after the first, the spread
# (25th-75th percentile) and the peak memory. MoE rows run under --profile on both sides (its two profiled steps,
# 10 and 11, left out of the median); the "after" trace: $OUT/moe_trace.json.gz, read by scripts/trace_launches.py.
BASE=${1:?usage: gpu_before_after.sh BASE_DIR [ROW ...]}; shift
ROWS=${*:-moe 4L}; STEPS=${STEPS:-20}
export PYTHONUNBUFFERED=1 RUNS=runs/before_after OUT=${OUT:-runs/before_after/out}
mkdir -p "$OUT" "$RUNS"
D=benchmarks/data/gpu
args() {
  case $1 in
    moe) echo "$D/moe.yaml" ;;
    moe-gc) echo "$D/moe.yaml --manual-gc" ;;
    4L) echo "$D/llama1b.yaml --num-layers 4" ;;
    4L-fp16) echo "$D/llama1b.yaml --num-layers 4 --fp16" ;;
    16L) echo "$D/llama1b.yaml" ;;
    *) echo "unknown row $1 (moe, moe-gc, 4L, 4L-fp16, 16L)" >&2; exit 2 ;;
  esac
}
summary() {  # metrics.jsonl [profiled steps] -> median ms, p25-p75, peak MiB
  python3 - "$@" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
skip = {int(s) for s in sys.argv[2:]}
ms = sorted(r["step_time_s"] * 1e3 for r in rows[1:] if r["step"] not in skip)
q = statistics.quantiles(ms, n=4)
print(f"median {statistics.median(ms):7.1f} ms  p25-p75 {q[0]:.1f}-{q[2]:.1f}  over {len(ms)} steps  "
      f"peak {max(max(r.get('peak_memory_mib', [0])) for r in rows):.0f} MiB  loss {rows[-1]['loss']:.4f}")
EOF
}
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
for row in $ROWS; do
  a=$(args "$row") || exit 2
  for side in before after; do
    path=$BASE; extra=""
    [ $side = after ] && path=$PWD
    [ "${row%%-*}" = moe ] && extra=--profile
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout 240 python3 -m fivefold train $a --out $RUNS/$row-$side --train-iters "$STEPS" $extra \
      > $RUNS/$row-$side.log 2>&1 || { echo "$row $side failed:"; tail -5 $RUNS/$row-$side.log; continue; }
    cp $RUNS/$row-$side/metrics.jsonl "$OUT/$row-$side.jsonl"
    printf '%-9s %-6s ' "$row" "$side"
    if [ -n "$extra" ]; then
      summary $RUNS/$row-$side/metrics.jsonl 10 11  # fivefold.train.profile's window
      [ $side = after ] && gzip -c $RUNS/$row-$side/profile/rank-0.pt.trace.json > "$OUT/${row}_trace.json.gz"
    else
      summary $RUNS/$row-$side/metrics.jsonl
    fi
  done
done
for t in "$OUT"/*_trace.json.gz; do [ -e "$t" ] && { gunzip -c "$t" > $RUNS/trace.json; python3 scripts/trace_launches.py $RUNS/trace.json | head -3; }; done
