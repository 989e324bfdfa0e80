#!/bin/sh
# The CPU tables of docs/results/ through the one runner (benchmarks/run.py), one target per table, into
# docs/results/ (or $OUT). Run from the repository root. Every table starts with the runner's stamp (command, CPU
# model and flags, torch, threads, date). The timing tables compare mixers against attention in interleaved
# rounds, but absolute times move with load: make them on an otherwise idle machine. Launch counts and live-storage
# memory are exact under any load.
#   sh benchmarks/cpu_tables.sh                  # every table below (about 45 minutes on an idle 2-core VM)
#   sh benchmarks/cpu_tables.sh launches         # launch_counts_cpu.{md,json} (~8 min; exact, under any load)
#   sh benchmarks/cpu_tables.sh gpu-path         # memory_gpu_path_d{256,1024}_cpu.{md,json} (~15 min; exact)
#   sh benchmarks/cpu_tables.sh table            # efficiency_cpu/table.{md,json}: training step + decode (timing)
#   sh benchmarks/cpu_tables.sh decode           # efficiency_cpu/decode_{1,2}thread.{md,json} (timing)
#   sh benchmarks/cpu_tables.sh decode-ovq       # efficiency_cpu/decode_ovq_plateau.{txt,json} (timing)
#   sh benchmarks/cpu_tables.sh model4-memory    # efficiency_cpu/model4_memory*.{md,json} (live storages: exact;
#                                                #   the resident-set column moves with the allocator)
#   sh benchmarks/cpu_tables.sh model4-speed     # efficiency_cpu/model4_speed_8k_activation_checkpointing.txt (timing)
set -eu
OUT=${OUT:-docs/results}
E=$OUT/efficiency_cpu
RUN="python benchmarks/run.py"
ONLY=${1:-all}
case $ONLY in
    all|launches|gpu-path|table|decode|decode-ovq|model4-memory|model4-speed) ;;
    *) echo "cpu_tables.sh: no table '$ONLY'; one of: all launches gpu-path table decode decode-ovq model4-memory" \
            "model4-speed" >&2; exit 2 ;;
esac
want() { [ "$ONLY" = all ] || [ "$ONLY" = "$1" ]; }
mkdir -p "$E"

# Launch count: operators, kernel launches and host syncs of one training step and one decode step, every mixer,
# the GPU's Triton paths (/triton) included; their kernels counted, not run (the interpreter takes minutes at 32k;
# docs/results/launch_counts_triton_interpreted_cpu.md has them run, the same counts).
if want launches; then
    $RUN --measure launches --mixers all --lengths 2048 8192 32768 --max-len --threads 1 --skip-kernels \
        --json $OUT/launch_counts_cpu.json > $OUT/launch_counts_cpu.md
fi

# Training memory of the GPU paths (/triton) against attention's at 8k and 32k, at the benchmark's d_model and at
# the GPU table's (1024, head_dim 128): live tensor storages, kernels launched but not run (the same allocations).
if want gpu-path; then
    for d in 256 1024; do
        $RUN --measure train --memory-only --skip-kernels --mixers attention kvm-256/triton kvm-sqrt/triton \
            ovq/triton trellis/triton --lengths 8192 32768 --threads 1 --d-model $d --head-dim 128 \
            --json $OUT/memory_gpu_path_d${d}_cpu.json > $OUT/memory_gpu_path_d${d}_cpu.md
    done
fi

# Training step (time, resident / live / kept memory) at 4k-32k, and a first decode column.
if want table; then
    $RUN --mixers attention kvm-256 kvm-sqrt ovq trellis gdn gsa swa-512 tova-512 \
        --lengths 4096 8192 16384 32768 --max-len kvm-sqrt=32768 ovq=32768 trellis=16384 gdn=16384 gsa=16384 \
        swa-512=16384 --repeats 5 --threads 2 --decode-contexts 1024 16384 \
        --json $E/table.json > $E/table.md
fi

# Decode ms/token and state bytes at 1k and 16k, 9 rounds of 100 steps, 2 threads then 1 thread.
if want decode; then
    for t in 2 1; do
        $RUN --measure decode --decode-contexts 1024 16384 --decode-steps 100 --decode-rounds 9 --threads $t \
            --json $E/decode_${t}thread.json > $E/decode_${t}thread.md
    done
fi

# OVQ's decode as its dictionary fills (up to 128k tokens of context).
if want decode-ovq; then
    $RUN --measure decode --mixers ovq --decode-contexts 1024 16384 65536 131072 --decode-steps 100 \
        --decode-rounds 16 --threads 1 --json $E/decode_ovq_plateau.json > $E/decode_ovq_plateau.txt
fi

# 4-block language models: memory of one training step, without and with activation checkpointing.
if want model4-memory; then
    for ac in "" --activation-checkpointing; do
        name=model4_memory${ac:+_activation_checkpointing}
        $RUN --measure train --model-layers 4 --mixers attention kvm-256 kvm-sqrt ovq trellis gdn gsa \
            --lengths 4096 8192 16384 --threads 1 --memory-only $ac --decode-contexts --json $E/$name.json \
            > $E/$name.md
    done
fi

# 4-block language models: step time at 8k, without and with activation checkpointing.
if want model4-speed; then
    for ac in "" --activation-checkpointing; do
        $RUN --measure train --model-layers 4 --mixers attention kvm-256 kvm-sqrt ovq --lengths 8192 --repeats 3 \
            --threads 2 --decode-contexts $ac
    done > $E/model4_speed_8k_activation_checkpointing.txt
fi
