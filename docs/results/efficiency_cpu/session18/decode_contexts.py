"""Decode ms/token of one mixer of bench_efficiency.py at several contexts, with bench_efficiency's decode_rounds (every
context prefilled once in one process, 100-step runs from each prefilled state, the contexts in turn, rotated each
round), one thread, medians; prints the state's rows where the state has a dictionary (OVQ's ``dk``). Session 18: is
OVQ's decode flat once its dictionary plateaus? Usage: decode_contexts.py MIXER T1 T2 ... [--rounds R]"""
import os, statistics as st, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
import bench_efficiency as b

torch.set_num_threads(1)
argv = sys.argv[1:]
rounds = 7
if "--rounds" in argv:
    i = argv.index("--rounds")
    rounds = int(argv[i + 1])
    del argv[i:i + 2]
name, contexts = argv[0], [int(a) for a in argv[1:]]
torch.manual_seed(0)
layer = b.build(name, {"threads": 1})
with torch.no_grad():  # the state's size at each context (decode_rounds keeps its states to itself)
    for T in contexts:
        s = None
        for a in range(0, T, 4096):
            _, s = layer.eval()(torch.randn(1, min(4096, T - a), 256), s)
        print(f"T={T}: state rows {getattr(s, 'dk', torch.empty(0, 0)).shape[-2]}", flush=True)
res = b.decode_rounds(layer, contexts, steps=100, rounds=rounds)
print({T: [round(v, 3) for v in v_] for T, v_ in res.items()})
base = contexts[0]
for T in contexts:
    ratio = st.median([v / u for u, v in zip(res[base], res[T])])
    print(f"{name} T={T:>6} median ms/token {st.median(res[T]):.3f}  vs T={base}: {ratio:.3f}x")
