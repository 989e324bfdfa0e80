import torch, time
torch.set_num_threads(2)
f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
fb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
B, H, Lq, n, D = 1, 2, 128, 2048, 128
q = torch.randn(B, H, Lq, D) / 4; k = torch.randn(B, H, n, D); v = torch.randn(B, H, n, D)
lc = torch.rand(B, H, n).log()
prior = lc[:, :, None, :].expand(B, H, Lq, n)
def run(q, k, v, mask):
    o, lse = f(q, k, v, attn_mask=mask, scale=1.0)
    g = torch.randn_like(o)
    fb(g, q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=1.0)
def pad(E):
    qq = torch.zeros(B, H, Lq, E); qq[..., :D] = q; qq[..., D] = 1
    kk = torch.zeros(B, H, n, E); kk[..., :D] = k; kk[..., D] = lc
    vv = torch.zeros(B, H, n, E); vv[..., :D] = v
    return qq, kk, vv
cases = {"mask D=128": (q, k, v, prior), "mask contiguous D=128": (q, k, v, prior.contiguous())}
for E in (129, 132, 136, 144):
    cases[f"nomask E={E}"] = (*pad(E), None)
for name, c in cases.items():
    run(*c)
res = {k: [] for k in cases}
for _ in range(15):
    for name, c in cases.items():
        t0 = time.perf_counter(); run(*c); res[name].append(time.perf_counter() - t0)
for name, t in res.items():
    t.sort(); print(f"{name}: median {t[len(t)//2]*1e3:.2f} ms")
# forward only
for name, c in cases.items():
    ts = []
    for _ in range(15):
        t0 = time.perf_counter(); f(c[0], c[1], c[2], attn_mask=c[3], scale=1.0); ts.append(time.perf_counter() - t0)
    ts.sort(); print(f"fwd {name}: {ts[7]*1e3:.2f} ms")
