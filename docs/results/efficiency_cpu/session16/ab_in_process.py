"""In-process A/B of KVM_BYFOLD: alternate steps of one layer with the env var 0 / 1."""
import os, sys, time, statistics as st
sys.path.insert(0, "/work/main/benchmarks")
import torch
import bench_efficiency as b
name, T, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": 2}
layer = b.build(name, task); x = b.inputs(task, T)
b.step(layer, x[:, :1024], task)
times = {"0": [], "1": []}
for i in range(n + 1):
    for e in ("0", "1") if i % 2 else ("1", "0"):
        os.environ["KVM_BYFOLD"] = e
        t0 = time.perf_counter(); b.step(layer, x, task); dt = time.perf_counter() - t0
        if i: times[e].append(dt)
for e, t in times.items():
    print(f"BYFOLD={e} {name} T={T}: median {st.median(t):.3f} s, min {min(t):.3f}, steps {' '.join('%.3f' % v for v in t)}")
print(f"ratio of medians 1/0: {st.median(times['1']) / st.median(times['0']):.3f}, of mins {min(times['1'])/min(times['0']):.3f}")
