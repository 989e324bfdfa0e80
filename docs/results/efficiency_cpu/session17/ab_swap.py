"""In-process A/B of one layer's training step with a module attribute swapped (session 17, issue #17): the
variants alternate in one process, order reversed every round. Usage: ab_swap.py MIXER T ROUNDS MODULE ATTR EXPR
where EXPR (a Python expression with torch imported) is the 'before' value; 'after' is the installed one."""
import importlib, os, statistics as st, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
import bench_efficiency as b
mixer, T, rounds, module, attr, expr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:7]
mod = importlib.import_module(module)
variants = {"before": eval(expr), "after": getattr(mod, attr)}
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
task = {"threads": torch.get_num_threads()}
layer, x = b.build(mixer, task), b.inputs(task, T)
b.step(layer, x[:, :1024], task)
times = {k: [] for k in variants}
for r in range(rounds):
    for k in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
        setattr(mod, attr, variants[k])
        t0 = time.perf_counter(); b.step(layer, x, task); times[k].append(time.perf_counter() - t0)
print({k: [round(t, 3) for t in v] for k, v in times.items()})
ratios = [a / c for a, c in zip(times["after"], times["before"])]
print(f"{mixer} T={T} after/before median {st.median(ratios):.3f} min-ratio {min(times['after'])/min(times['before']):.3f} "
      f"before median {st.median(times['before']):.3f} s after median {st.median(times['after']):.3f} s")
