#!/bin/bash
# usage: ab_processes.sh T mixer rounds repeats: alternating processes of the code in a worktree at /tmp/before
# (git worktree add -f /tmp/before <rev>) and of the installed tree, each timing attention and the mixer
cd "$(dirname "$0")/../../../.." && . .venv/bin/activate
T=$1; M=$2; R=$3; N=$4
BEFORE="$(ls -d /tmp/before/plugins/*/src | tr '\n' ':')/tmp/before"
for r in $(seq $R); do for e in before after; do
  if [ $e = before ]; then PP=$BEFORE; else PP=""; fi
  out=$(PYTHONPATH=$PP OMP_NUM_THREADS=2 python benchmarks/bench_efficiency.py --worker "{\"what\":\"time\",\"T\":$T,\"mixers\":[\"attention\",\"$M\"],\"repeats\":$N,\"threads\":2}" 2>&1 | tail -1)
  echo "$e $out"
done; done
