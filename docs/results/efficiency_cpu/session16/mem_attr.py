"""Live and kept tensor MiB of one training step of a layer with ``attr`` set to each value (one process)."""
import sys
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "../../../../benchmarks"))
import torch
import bench_efficiency as b
from mixerzoo.evaluation.cost import LiveTensorBytes
name, attr = sys.argv[1], sys.argv[2]
values, lengths = [int(v) for v in sys.argv[3].split(",")], [int(t) for t in sys.argv[4].split(",")]
torch.set_num_threads(1)
task = {"threads": 1}
layer = b.build(name, task)
b.step(layer, b.inputs(task, 1024), task)
for T in lengths:
    x = b.inputs(task, T)
    for v in values:
        setattr(layer, attr, v)
        layer.zero_grad(set_to_none=True); x.grad = None
        with LiveTensorBytes(exclude=[*layer.parameters(), x]) as live:
            y, _ = layer(x)
            kept = live.current
            b.loss_of(y, x, task).backward()
            del y
        print(f"{name} T={T} {attr}={v}: live {live.peak / 2**20:.1f} MiB, kept {kept / 2**20:.1f} MiB", flush=True)
