"""OVQ decode, one thread: each of 512 single-token steps after 1k and 16k prefills timed alone (the merge every
128 tokens shows as the largest steps; session 17)."""
import os, sys, time, statistics as st
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../benchmarks"))
import torch
import bench_efficiency as b
torch.set_num_threads(1)
layer = b.build("ovq", {"threads": 1}).eval()
x = torch.randn(1, 16384 + 600, 256)
for T in (1024, 16384):
    with torch.no_grad():
        s = None
        for a in range(0, T, 4096):
            _, s = layer(x[:, a:min(a + 4096, T)], s)
        ts = []
        for t in range(T, T + 512):
            t0 = time.perf_counter(); _, s = layer(x[:, t:t + 1], s); ts.append(time.perf_counter() - t0)
    ts = [1e3 * v for v in ts]
    big = sorted(ts)[-4:]
    print(T, f"mean {st.mean(ts):.3f} median {st.median(ts):.3f} 4 largest {[round(v, 2) for v in big]} "
          f"mean without them {st.mean(sorted(ts)[:-4]):.3f}")
