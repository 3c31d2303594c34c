#!/bin/bash
# Our runtime's one-GPU rows before and after a change, on one machine in one call of a lent GPU (timings
# compare only on the same machine; ~2 min a row on an H100):
#   git archive REV fivefold | tar -x -C runs/base      # here, first: the package as it was (runs/ is ignored)
#   bash scripts/gpu_before_after.sh runs/base [ROW ...]  # on the GPU, carrying runs/base
# ROW: moe, moe-gc (--manual-gc), 4L, 4L-fp16, 16L (default: moe 4L). Each row is trained STEPS steps (default 16)
# with the package in runs/base ("before") and with this tree's ("after"), in the order ORDER (default
# "before after after before": a drift over the call (later runs slower, as seen on an H100),
# falls on both sides alike); printed per run: the median step time of the steps after the first, the
# spread (25th-75th percentile) and the peak memory, then each side's mean of its medians. MoE rows run
# under --profile (its two profiled steps, 10 and 11, left out of the median); the first "after" run's
# trace: $OUT/<row>_trace.json.gz, read by scripts/trace_launches.py.
BASE=${1:?usage: gpu_before_after.sh BASE_DIR [ROW ...]}; shift
ROWS=${*:-moe 4L}; STEPS=${STEPS:-16}; ORDER=${ORDER:-before after after before}
export PYTHONUNBUFFERED=1 RUNS=runs/before_after OUT=${OUT:-runs/before_after/out}
mkdir -p "$OUT" "$RUNS"
D=${D:-benchmarks/data/gpu}  # (another folder of moe.yaml and llama1b.yaml: a dry run on the CPU)
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
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader 2>/dev/null || echo "no GPU here (a dry run)"
for row in $ROWS; do
  a=$(args "$row") || exit 2
  declare -A sum=() runs=()
  k=0
  for side in $ORDER; do
    k=$((k + 1)); path=$BASE; extra=""; run=$row-$side-$k
    [ $side = after ] && path=$PWD
    [ "${row%%-*}" = moe ] && extra=--profile
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout 240 python3 -m fivefold train $a --out $RUNS/$run --train-iters "$STEPS" $extra \
      > $RUNS/$run.log 2>&1 || { echo "$run failed:"; tail -5 $RUNS/$run.log; continue; }
    [ -e "$OUT/$row-$side.jsonl" ] || cp $RUNS/$run/metrics.jsonl "$OUT/$row-$side.jsonl"
    printf '%-16s ' "$run"
    if [ -n "$extra" ]; then
      line=$(summary $RUNS/$run/metrics.jsonl 10 11)  # fivefold.train.profile's window
      [ $side = after ] && [ ! -e "$OUT/${row}_trace.json.gz" ] && \
        gzip -c $RUNS/$run/profile/rank-0.pt.trace.json > "$OUT/${row}_trace.json.gz"
    else
      line=$(summary $RUNS/$run/metrics.jsonl)
    fi
    echo "$line"
    ms=$(echo "$line" | awk '{print $2}')
    sum[$side]=$(python3 -c "print(${sum[$side]:-0} + $ms)"); runs[$side]=$(( ${runs[$side]:-0} + 1 ))
  done
  for side in before after; do
    [ -n "${runs[$side]}" ] && python3 -c "print(f'$row $side: mean of {${runs[$side]}} medians {${sum[$side]} / ${runs[$side]}:.1f} ms')"
  done
  unset sum runs
done
for t in "$OUT"/*_trace.json.gz; do [ -e "$t" ] && { gunzip -c "$t" > $RUNS/trace.json; python3 scripts/trace_launches.py $RUNS/trace.json | head -3; }; done
