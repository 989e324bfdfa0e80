"""Training-step time of KVM-256 with recomputed groups of 1, 2 and 4 chunks (checkpoint_chunks) against attention,
interleaved rounds in one process through bench_efficiency's timing worker, 2 threads; medians and the median of
per-round ratios. Usage: group_size_speed.py T [ROUNDS]. Session 18."""
import os, statistics as st, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import bench_efficiency as B

T = int(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
kind, opts = B.MIXERS["kvm-256"]
names = ["attention"]
for cc in (4, 2, 1):
    B.MIXERS[f"kvm-256/cc{cc}"] = (kind, dict(opts, checkpoint_chunks=cc))
    names.append(f"kvm-256/cc{cc}")
times = B.worker({"what": "time", "T": T, "mixers": names, "repeats": rounds, "threads": 2})
for n in names:
    ratio = st.median(a / b for a, b in zip(times["attention"], times[n]))
    vs4 = st.median(b / a for a, b in zip(times["kvm-256/cc4"], times[n]))
    print(f"T={T} {n:14s} median {st.median(times[n]):.3f} s  speed vs attention {ratio:.2f}x  step vs cc4 {vs4:.3f}x  "
          f"rounds {[round(t, 3) for t in times[n]]}")
