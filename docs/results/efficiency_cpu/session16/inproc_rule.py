"""In-process A/B of KVM's long groups for large states: packed._group_chunks with and without rows_per_step."""
import os, sys, time, statistics as st
sys.path.insert(0, "/work/main/benchmarks")
import torch
import bench_efficiency as b
from mixerzoo_kvm import packed
name, T, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
scale = [float(v) for v in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0, 1]
torch.set_num_threads(2)
task = {"threads": 2}
orig = packed._group_chunks
def with_scale(s):
    def g(rows, **kw):
        r = kw.pop("rows_per_step", None)
        return orig(rows, **kw, rows_per_step=int(r * s) if (r and s) else None)
    return g
layer = b.build(name, task); x = b.inputs(task, T)
b.step(layer, x[:, :1024], task)
times = {s: [] for s in scale}
for i in range(n + 1):
    for s in (scale if i % 2 else scale[::-1]):
        packed._group_chunks = with_scale(s)
        t0 = time.perf_counter(); b.step(layer, x, task); dt = time.perf_counter() - t0
        if i: times[s].append(dt)
base = st.median(times[scale[0]])
for s, t in times.items():
    print(f"rows_per_step x{s} (0: none) {name} T={T}: median {st.median(t):.3f} s ({st.median(t)/base:.3f}x), min {min(t):.3f}")
