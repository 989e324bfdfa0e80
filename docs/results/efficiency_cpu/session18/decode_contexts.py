"""Decode ms/token of one mixer of bench_efficiency.py at several contexts, states prefilled in one process and the
contexts' 100-step runs alternating (rotated order each round), one thread, medians over rounds; prints the state's
size where the layer reports one (OVQ: dictionary rows). Session 18: is OVQ's decode flat once its dictionary
plateaus? Usage: decode_contexts.py MIXER T1 T2 ... [--rounds R]"""
import os, statistics as st, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
import bench_efficiency as b

torch.set_num_threads(1)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
if "--rounds" in sys.argv:
    args.remove(str(rounds))
name, contexts = args[0], [int(a) for a in args[1:]]
layer = b.build(name, {"threads": 1}).eval()
torch.manual_seed(0)
x = torch.randn(1, max(contexts) + 1000, 256)
states, rows = {}, {}
with torch.no_grad():
    for T in contexts:
        s, t0 = None, time.perf_counter()
        for a in range(0, T, 4096):
            _, s = layer(x[:, a:min(a + 4096, T)], s)
        states[T] = s
        dk = getattr(s, "dk", None)
        rows[T] = None if dk is None else dk.shape[-2]
        print(f"prefill {T}: {time.perf_counter() - t0:.1f} s, state rows {rows[T]}", flush=True)


def run(T, steps=100):
    s = states[T]
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(T, T + steps):
            _, s = layer(x[:, t:t + 1], s)
    return 1e3 * (time.perf_counter() - t0) / steps


res = {T: [] for T in contexts}
for r in range(rounds):
    order = contexts[r % len(contexts):] + contexts[:r % len(contexts)]
    for T in order:
        res[T].append(run(T))
print({T: [round(v, 3) for v in v_] for T, v_ in res.items()})
base = contexts[0]
for T in contexts:
    ratio = st.median([v / u for u, v in zip(res[base], res[T])])
    print(f"{name} T={T:>6} rows {rows[T]} median ms/token {st.median(res[T]):.3f}  vs T={base}: {ratio:.3f}x")
