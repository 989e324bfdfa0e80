"""In-process A/B of a layer attribute: alternate steps of one layer with ``attr`` set to each value."""
import os, sys, time, statistics as st
sys.path.insert(0, "/work/main/benchmarks")
import torch
import bench_efficiency as b
name, T, n, attr, values = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], [int(v) for v in sys.argv[5].split(",")]
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": 2}
layer = b.build(name, task); x = b.inputs(task, T)
b.step(layer, x[:, :1024], task)
times = {v: [] for v in values}
for i in range(n + 1):
    for v in (values if i % 2 else values[::-1]):
        setattr(layer, attr, v)
        t0 = time.perf_counter(); b.step(layer, x, task); dt = time.perf_counter() - t0
        if i: times[v].append(dt)
base = st.median(times[values[0]])
for v, t in times.items():
    print(f"{attr}={v} {name} T={T}: median {st.median(t):.3f} s ({st.median(t)/base:.3f}x), min {min(t):.3f}")
