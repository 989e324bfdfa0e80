import torch, time, sys
torch.set_num_threads(2)
f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
fb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
N, Lq, S, D = 2, 256, int(sys.argv[1]), 128
q = torch.randn(N, 1, Lq, D) / 4; k = torch.randn(N, 1, S, D); v = torch.randn(N, 1, S, D)
mask = torch.zeros(1, 1, Lq, S); mask[..., :512] = torch.zeros(Lq, 512).masked_fill(torch.ones(Lq, 512, dtype=torch.bool).triu(257), float("-inf"))
g = torch.randn(N, 1, Lq, D)
o, lse = f(q, k, v, attn_mask=mask, scale=D**-0.5)
def flash_bwd():
    return fb(g, q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=D**-0.5)
def manual_bwd():
    qq, kk, vv, gg, oo = (t.view(N, -1, D) for t in (q, k, v, g, o))
    Sm = torch.baddbmm(mask.view(1, Lq, S), qq, kk.transpose(1, 2), alpha=D**-0.5)
    P = Sm.sub_(lse.view(N, Lq, 1)).exp_()
    dv = torch.bmm(P.transpose(1, 2), gg)
    dP = torch.bmm(gg, vv.transpose(1, 2))
    delta = (gg * oo).sum(-1, keepdim=True)
    dS = dP.sub_(delta).mul_(P)
    dq = torch.bmm(dS, kk).mul_(D**-0.5)
    dk = torch.bmm(dS.transpose(1, 2), qq).mul_(D**-0.5)
    return dq, dk, dv
a, b = flash_bwd(), manual_bwd()
print([(x.reshape(-1) - y.reshape(-1)).abs().max().item() for x, y in zip(a, b)])
res = {"flash": [], "manual": []}
for _ in range(20):
    for name, fn in (("flash", flash_bwd), ("manual", manual_bwd)):
        t0 = time.perf_counter(); fn(); res[name].append(time.perf_counter() - t0)
for name, t in res.items():
    t.sort(); print(f"S={S} {name}: median {t[len(t)//2]*1e3:.2f} ms min {t[0]*1e3:.2f}")
t=[]
for _ in range(20):
    t0 = time.perf_counter(); f(q, k, v, attn_mask=mask, scale=D**-0.5); t.append(time.perf_counter() - t0)
t.sort(); print(f"S={S} flash fwd median {t[10]*1e3:.2f}")
