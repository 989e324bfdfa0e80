#!/bin/bash
# usage: abrev.sh T mixer rounds repeats -> alternating before (HEAD worktree) / after (installed) processes
cd /work/main && . .venv/bin/activate
T=$1; M=$2; R=$3; N=$4
BEFORE="$(ls -d /tmp/before/plugins/*/src | tr '\n' ':')/tmp/before"
for r in $(seq $R); do for e in before after; do
  if [ $e = before ]; then PP=$BEFORE; else PP=""; fi
  out=$(PYTHONPATH=$PP OMP_NUM_THREADS=2 python benchmarks/bench_efficiency.py --worker "{\"what\":\"time\",\"T\":$T,\"mixers\":[\"attention\",\"$M\"],\"repeats\":$N,\"threads\":2}" 2>&1 | tail -1)
  echo "$e $out"
done; done
