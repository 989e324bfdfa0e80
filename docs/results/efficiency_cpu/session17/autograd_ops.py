"""Operators that autograd's own backward nodes run in one training step (no mixerzoo frame), by operator and
shape: what the op-lines table's blank line is made of."""
import collections, os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import bench_efficiency as b
name, T = sys.argv[1], int(sys.argv[2])
spent = collections.defaultdict(lambda: [0.0, 0])
class Timed(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if not b.calling_line():
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))[:2]
            e = spent[(str(func), shapes)]
            e[0] += time.perf_counter() - t0; e[1] += 1
        return out
task = {"threads": 2}
torch.set_num_threads(2)
layer, x = b.warmed_up(name, T, task)
with Timed():
    b.step(layer, x, task)
for k, (s, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{s*1e3:8.1f} ms {n:5d} {k[0]} {k[1]}")
