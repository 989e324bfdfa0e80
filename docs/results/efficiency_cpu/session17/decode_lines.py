"""Decode (OVQ by default; any mixer of bench_efficiency.py as the first argument): ms/token at 1k and 16k contexts
alternating in one process (1 thread; THREADS=n from the environment), and the per-line operator time of 200 decode
steps at each unless --no-lines (session 17)."""
import collections, os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import bench_efficiency as b
torch.set_num_threads(int(os.environ.get("THREADS", "1")))  # session 18: THREADS=2
name = sys.argv[1] if len(sys.argv) > 1 else "ovq"
lines = "--no-lines" not in sys.argv
task = {"threads": 1}
layer = b.build(name, task).eval()
states = {}
x = torch.randn(1, 16384 + 2000, 256)
with torch.no_grad():
    for T in (1024, 16384):
        s = None
        for a in range(0, T, 4096):
            _, s = layer(x[:, a:min(a + 4096, T)], s)
        states[T] = s
def run(T, steps=100, mode=None):
    s = states[T]
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(T, T + steps):
            _, s = layer(x[:, t:t + 1], s)
    return 1e3 * (time.perf_counter() - t0) / steps
res = {1024: [], 16384: []}
for r in range(7):
    for T in ((1024, 16384) if r % 2 == 0 else (16384, 1024)):
        res[T].append(run(T))
print({T: [round(v, 3) for v in r] for T, r in res.items()})
print(f"median ms/token 1k {st.median(res[1024]):.3f} 16k {st.median(res[16384]):.3f} ratio "
      f"{st.median([b_ / a for a, b_ in zip(res[1024], res[16384])]):.3f}")
for T in ((1024, 16384) if lines else ()):
    spent = collections.defaultdict(lambda: [0.0, 0])
    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            e = spent[(b.calling_line(), str(func).removesuffix(".default"))]
            e[0] += time.perf_counter() - t0; e[1] += 1
            return out
    with Timed():
        run(T, 200)
    print(f"\n# T={T}: {sum(v[0] for v in spent.values()) * 1e3 / 200:.3f} ms/token in operators")
    for k, (s_, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"{s_ * 1e3 / 200:7.4f} ms/tok {n // 200:3d}/tok {k[0]} {k[1]}")
