import torch, time
torch.set_num_threads(2)
f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
fb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
B, H, Lq, n, D = 1, 2, 128, 2048, 128
q = torch.randn(B, H, Lq, D) / 4; k = torch.randn(B, H, n, D); v = torch.randn(B, H, n, D)
lc = torch.rand(B, H, n).log()
prior = lc[:, :, None, :].expand(B, H, Lq, n)
g = torch.randn(B, H, Lq, D)
def flash():
    o, lse = f(q, k, v, attn_mask=prior, scale=1.0)
    return fb(g, q, k, v, o, lse, 0.0, False, attn_mask=prior, scale=1.0), o, lse
def manual():
    S = torch.baddbmm(lc.view(B*H, 1, n), q.view(B*H, Lq, D), k.view(B*H, n, D).transpose(1, 2))
    lse = S.logsumexp(-1, keepdim=True)
    P = S.sub_(lse).exp_()
    o = torch.bmm(P, v.view(B*H, n, D))
    # backward (recompute P from S again would cost one more bmm; here P kept)
    gg = g.view(B*H, Lq, D)
    dv = torch.bmm(P.transpose(1, 2), gg)
    dP = torch.bmm(gg, v.view(B*H, n, D).transpose(1, 2))
    delta = (gg * o).sum(-1, keepdim=True)
    dS = dP.sub_(delta).mul_(P)
    dq = torch.bmm(dS, k.view(B*H, n, D))
    dk = torch.bmm(dS.transpose(1, 2), q.view(B*H, Lq, D))
    return (dq, dk, dv), o, lse
(a, oa, la), (b, ob, lb) = flash(), manual()
print("max diff o", (oa.view(-1) - ob.view(-1)).abs().max().item(), [ (x.reshape(-1)-y.reshape(-1)).abs().max().item() for x, y in zip(a, b)])
for fn in (flash, manual): fn()
res = {"flash": [], "manual": []}
for _ in range(20):
    for name, fn in (("flash", flash), ("manual", manual)):
        t0 = time.perf_counter(); fn(); res[name].append(time.perf_counter() - t0)
for name, t in res.items():
    t.sort(); print(f"{name}: median {t[len(t)//2]*1e3:.2f} ms min {t[0]*1e3:.2f}")
