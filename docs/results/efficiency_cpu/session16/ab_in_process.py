"""In-process A/B of one layer's training step (issue #17, session 16): steps of the variants alternate in one
process (the order reversed every round), so load swings hit every variant alike. Variants are one of:

    python ab_in_process.py kvm-256 8192 12 --env "KVM_BYFOLD=0;KVM_BYFOLD=1"        # environment settings
    python ab_in_process.py kvm-sqrt 16384 6 --attr checkpoint_chunks 4,8,12          # a layer attribute
    python ab_in_process.py kvm-sqrt 32768 4 --rule 0,1,0.5                           # the trial group rule
    python ab_in_process.py kvm-sqrt 32768 4 --module-attr mixerzoo_kvm.packed.LONG_CALL_CHUNKS 64,1000000

``--rule`` scales the ``rows_per_step`` that ``kvm_packed`` passes to ``packed._group_chunks`` (0: none); it needs
a tree where ``_group_chunks`` takes ``rows_per_step`` (not kept). The first variant is the reference of the ratios.
Set ``OMP_NUM_THREADS`` for the thread count (default 2)."""
import argparse
import os
import statistics as st
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../benchmarks"))
import torch  # noqa: E402

import bench_efficiency as b  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("mixer")
ap.add_argument("T", type=int)
ap.add_argument("rounds", type=int)
how = ap.add_mutually_exclusive_group(required=True)
how.add_argument("--env", help="variants as 'K=V,K=V;K=V'")
how.add_argument("--attr", nargs=2, metavar=("NAME", "VALUES"))
how.add_argument("--rule", help="scales of rows_per_step, comma-separated")
how.add_argument("--module-attr", nargs=2, metavar=("MODULE.NAME", "VALUES"), help="a module attribute's int values")
args = ap.parse_args()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": torch.get_num_threads()}
layer, x = b.build(args.mixer, task), b.inputs(task, args.T)
b.step(layer, x[:, :1024], task)

if args.env:
    variants = args.env.split(";")

    def use(v):
        for kv in v.split(","):
            key, value = kv.split("=")
            os.environ[key] = value
elif args.attr:
    variants = [int(v) for v in args.attr[1].split(",")]

    def use(v):
        setattr(layer, args.attr[0], v)
elif args.module_attr:
    import importlib
    module, name = args.module_attr[0].rsplit(".", 1)
    module, variants = importlib.import_module(module), [int(v) for v in args.module_attr[1].split(",")]

    def use(v):
        setattr(module, name, v)
else:
    from mixerzoo_kvm import packed
    variants, group_chunks = [float(v) for v in args.rule.split(",")], packed._group_chunks

    def use(v):
        def scaled(rows, **kw):
            r = kw.pop("rows_per_step", None)
            return group_chunks(rows, **kw, rows_per_step=int(r * v) if (r and v) else None)
        packed._group_chunks = scaled

times = {v: [] for v in variants}
for i in range(args.rounds + 1):  # round 0 warms every variant up
    for v in (variants if i % 2 else variants[::-1]):
        use(v)
        t0 = time.perf_counter()
        b.step(layer, x, task)
        if i:
            times[v].append(time.perf_counter() - t0)
base = st.median(times[variants[0]])
for v, t in times.items():
    print(f"{v} {args.mixer} T={args.T}: median {st.median(t):.3f} s ({st.median(t) / base:.3f}x), min {min(t):.3f}, "
          f"steps {' '.join(f'{s:.3f}' for s in t)}")
