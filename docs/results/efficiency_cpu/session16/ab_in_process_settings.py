"""In-process A/B/C of env settings: alternate steps of one layer under each setting (a;b;c with k=v,k=v)."""
import os, sys, time, statistics as st
sys.path.insert(0, "/work/main/benchmarks")
import torch
import bench_efficiency as b
name, T, n, settings = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(";")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": 2}
layer = b.build(name, task); x = b.inputs(task, T)
b.step(layer, x[:, :1024], task)
times = {s: [] for s in settings}
for i in range(n + 1):
    order = settings if i % 2 else settings[::-1]
    for s in order:
        for kv in s.split(","):
            k, v = kv.split("="); os.environ[k] = v
        t0 = time.perf_counter(); b.step(layer, x, task); dt = time.perf_counter() - t0
        if i: times[s].append(dt)
base = st.median(times[settings[0]])
for s, t in times.items():
    print(f"{s:>16} {name} T={T}: median {st.median(t):.3f} s ({st.median(t)/base:.3f}x), min {min(t):.3f}")
