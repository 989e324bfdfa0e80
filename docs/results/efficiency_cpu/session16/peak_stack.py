"""Where the live-tensor peak of one training step happens: ``python peak_stack.py MIXER T`` prints the peak, its
allocation count against the step's (and the forward's end), and the mixerzoo frames calling at that moment."""
import sys, traceback, torch
sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "../../../../benchmarks"))
import bench_efficiency as b
from mixerzoo.evaluation.cost import LiveTensorBytes
name, T = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
task = {"threads": 1}
class P(LiveTensorBytes):
    stack = None; n = 0; at = 0
    def _track(self, t):
        peak = self.peak; self.n += 1
        super()._track(t)
        if self.peak > peak:
            self.stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-3]
                          if "mixerzoo" in f.filename or "torch/utils/checkpoint" in f.filename]
            self.at = self.n
layer, x = b.warmed_up(name, T, task)
with P(exclude=[*layer.parameters(), x]) as mem:
    y, _ = layer(x)
    nf = mem.n
    b.loss_of(y, x, task).backward()
print(f"peak {mem.peak/2**20:.1f} MiB at allocation {mem.at} of {mem.n} (forward ended at {nf})")
print("\n".join(mem.stack))
