"""In-process A/B of OVQ's _MergeChunk (HEAD's gathers/scatter-add vs row index_select/index_add_), issue #17
session 17: steps alternate in one process, order reversed every round. Usage (the 16k runs of the README):

    git show d0820b3:plugins/mixerzoo-ovq/src/mixerzoo_ovq/ops.py > /tmp/ops_head.py
    OMP_NUM_THREADS=2 python ab_merge.py 16384 12 /tmp/ops_head.py
"""
import importlib.util, os, statistics as st, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
import bench_efficiency as b
import mixerzoo_ovq.ops as ops
spec = importlib.util.spec_from_file_location("ops_head", sys.argv[3]); head = importlib.util.module_from_spec(spec)
spec.loader.exec_module(head)
T, rounds = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": torch.get_num_threads()}
layer, x = b.build("ovq", task), b.inputs(task, T)
b.step(layer, x[:, :1024], task)
variants = {"head": head._MergeChunk, "new": ops._MergeChunk}
times = {k: [] for k in variants}
for r in range(rounds):
    for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
        ops._MergeChunk = variants[k]
        t0 = time.perf_counter(); b.step(layer, x, task); times[k].append(time.perf_counter() - t0)
print({k: [round(t, 3) for t in v] for k, v in times.items()})
ratios = [n / h for n, h in zip(times["new"], times["head"])]
print(f"T={T} new/head median {st.median(ratios):.3f} min-ratio {min(times['new'])/min(times['head']):.3f} "
      f"head median {st.median(times['head']):.3f} s new median {st.median(times['new']):.3f} s")
