"""One-layer memory of a KVM mixer of bench_efficiency.py with another checkpoint_chunks (its recomputed group size),
through bench_efficiency's memory worker (a fresh process per call): resident-set peak, live and kept MiB.
Usage: group_size_memory.py MIXER T CHECKPOINT_CHUNKS (attention: the third argument is ignored). Session 18."""
import sys, json, torch
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "../../../../benchmarks"))
import bench_efficiency as B
torch.set_num_threads(2)
name, T, cc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kind, opts = B.MIXERS[name]
if kind != "attention":
    opts = dict(opts, checkpoint_chunks=cc)
B.MIXERS["probe"] = (kind, opts)
r = B.worker({"what": "memory", "mixer": "probe", "T": T, "threads": 2})
print(name, T, cc, json.dumps({k: round(v, 1) for k, v in r.items()}))
