"""KVM-256 8k read shapes on the CPU flash kernels (2 threads): one chunk (256 queries, 768 keys = 512 window + 256
rows), no mask / additive mask / split into an unmasked and a causal call merged by log-sum-exp (session 17)."""
import torch, time
torch.set_num_threads(2)
f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
fb = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
def t(fn, r=60):
    for _ in range(5): fn()
    ts = []
    for _ in range(r):
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    ts.sort(); return ts[len(ts) // 2] * 1e3
q = torch.randn(2, 1, 256, 128); k = torch.randn(2, 1, 768, 128); v = torch.randn(2, 1, 768, 128)
vis = torch.ones(256, 768, dtype=torch.bool); vis[:, 512:] = torch.ones(256, 256, dtype=torch.bool).tril()
bmask = vis[None, None]
fmask = torch.zeros(256, 768).masked_fill(~vis, float("-inf"))[None, None]
go = torch.randn(2, 1, 256, 128)
for name, m in (("none", None), ("float", fmask)):
    o, lse = f(q, k, v, attn_mask=m, scale=None)
    print(name, "fwd %.3f ms" % t(lambda: f(q, k, v, attn_mask=m)), "bwd %.3f ms" % t(lambda: fb(go, q, k, v, o, lse, 0.0, False, attn_mask=m)))
# split: [512 unmasked] + [256 causal]
k1, v1, k2, v2 = k[:, :, :512], v[:, :, :512], k[:, :, 512:].contiguous(), v[:, :, 512:].contiguous()
k1, v1 = k1.contiguous(), v1.contiguous()
def split_fwd():
    o1, l1 = f(q, k1, v1)
    o2, l2 = f(q, k2, v2, is_causal=True)
    m = torch.logaddexp(l1, l2)
    return o1 * (l1 - m).exp()[..., None] + o2 * (l2 - m).exp()[..., None], m
o, lse = split_fwd()
o_ref, lse_ref = f(q, k, v, attn_mask=fmask)
print("split == masked:", (o - o_ref).abs().max().item(), (lse - lse_ref).abs().max().item())
def split_bwd():
    fb(go, q, k1, v1, o, lse, 0.0, False)
    fb(go, q, k2, v2, o, lse, 0.0, True)
print("split fwd %.3f ms" % t(split_fwd), "bwd %.3f ms" % t(split_bwd))
