import sys, time, json, torch
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench_efficiency as be
import mixerzoo_ovq
torch.set_num_threads(1)
out = {"from": mixerzoo_ovq.__file__}
for T in (1024, 16384, 32768):
    layer = be.build("ovq", {"threads": 1}); layer.eval()
    x = torch.randn(1, T + 256, 256)
    with torch.no_grad():
        st = None
        for a in range(0, T, 4096):
            _, st = layer(x[:, a:min(a+4096, T)], st)
        times = []
        for t in range(T, T + 256):
            t0 = time.perf_counter(); _, st = layer(x[:, t:t+1], st); times.append(time.perf_counter() - t0)
    s = sorted(times)
    out[T] = {"rows": st.dk.shape[2], "median_ms": round(1e3 * s[128], 4), "mean_ms": round(1e3 * sum(times) / 256, 4)}
print(json.dumps(out))
