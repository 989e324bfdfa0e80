#!/bin/bash
# usage: ab_processes_env.sh T mixer rounds: alternating KVM_BYFOLD=0 / 1 processes (with the patch applied)
cd "$(dirname "$0")/../../../.." && . .venv/bin/activate
T=$1; M=$2; R=$3
for r in $(seq $R); do for e in 0 1; do
  out=$(KVM_BYFOLD=$e OMP_NUM_THREADS=2 python benchmarks/bench_efficiency.py --worker "{\"what\":\"time\",\"T\":$T,\"mixers\":[\"attention\",\"$M\"],\"repeats\":3,\"threads\":2}" 2>&1 | tail -1)
  echo "$e $out"
done; done
