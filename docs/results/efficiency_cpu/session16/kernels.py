"""Micro-benchmarks of the reads' kernels on this CPU (issue #17, session 16): PyTorch's CPU flash attention
against the same computation written as batched matrix products, and OVQ's log-prior as a mask against the prior
folded into the keys as an extra channel.

    python kernels.py ovq-mask           # OVQ's dictionary read: prior as mask vs as a channel (no mask)
    python kernels.py ovq-backward       # OVQ's shape: flash forward + backward vs matmuls
    python kernels.py kvm-backward 3412  # KVM's shape (256 queries, S keys, a window mask): flash vs matmul backward
"""
import sys
import time

import torch

torch.set_num_threads(2)
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def timed(fns: dict, rounds: int = 20) -> None:
    """Median (and min) ms of each function, calls interleaved."""
    for fn in fns.values():
        fn()
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            res[name].append(time.perf_counter() - t0)
    for name, t in res.items():
        t.sort()
        print(f"{name}: median {t[len(t) // 2] * 1e3:.2f} ms min {t[0] * 1e3:.2f}")


def matmul_backward(q, k, v, g, o, lse, bias, scale):
    """The attention backward as five batched products (P recomputed from the scores): ``(dq, dk, dv)``."""
    N, Lq, D = q.shape
    P = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale).sub_(lse.view(N, Lq, 1)).exp_()
    dv = torch.bmm(P.transpose(1, 2), g)
    dS = torch.bmm(g, v.transpose(1, 2)).sub_((g * o).sum(-1, keepdim=True)).mul_(P)
    return torch.bmm(dS, k).mul_(scale), torch.bmm(dS.transpose(1, 2), q).mul_(scale), dv


def ovq(mode: str) -> None:
    B, H, Lq, n, D = 1, 2, 128, 2048, 128
    q, k, v = torch.randn(B, H, Lq, D) / 4, torch.randn(B, H, n, D), torch.randn(B, H, n, D)
    lc = torch.rand(B, H, n).log()
    prior = lc[:, :, None, :].expand(B, H, Lq, n)
    g = torch.randn(B, H, Lq, D)

    def step(q, k, v, mask, g=g):
        o, lse = flash(q, k, v, attn_mask=mask, scale=1.0)
        return flash_bwd(g, q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=1.0), o, lse
    if mode == "ovq-mask":
        def channel(E):  # queries [q, 1], keys [k, log c], values and the gradient zero-padded to E channels
            qq, kk, vv, gg = (torch.zeros(B, H, L, E) for L in (Lq, n, n, Lq))
            qq[..., :D], qq[..., D], kk[..., :D], kk[..., D], vv[..., :D], gg[..., :D] = q, 1, k, lc, v, g
            return qq, kk, vv, None, gg
        cases = {"mask D=128": (q, k, v, prior), "mask contiguous D=128": (q, k, v, prior.contiguous())}
        cases.update({f"nomask E={E}": channel(E) for E in (129, 132, 136, 144)})
        timed({name: (lambda c=c: step(*c)) for name, c in cases.items()}, 15)
        timed({f"fwd {name}": (lambda c=c: flash(c[0], c[1], c[2], attn_mask=c[3], scale=1.0))
               for name, c in cases.items()}, 15)
        return

    def manual():
        qq, kk, vv, gg = (t.view(B * H, -1, D) for t in (q, k, v, g))
        S = torch.baddbmm(lc.view(B * H, 1, n), qq, kk.transpose(1, 2))
        lse = S.logsumexp(-1)
        o = torch.bmm(S.sub_(lse[..., None]).exp_(), vv)
        return matmul_backward(qq, kk, vv, gg, o, lse, lc.view(B * H, 1, n), 1.0), o, lse
    (a, oa, _), (m, om, _) = step(q, k, v, prior), manual()
    print("max diff o", (oa.reshape(-1) - om.reshape(-1)).abs().max().item(),
          [(x.reshape(-1) - y.reshape(-1)).abs().max().item() for x, y in zip(a, m)])
    timed({"flash": lambda: step(q, k, v, prior), "manual": manual})


def kvm(S: int) -> None:
    N, Lq, D = 2, 256, 128
    q, k, v = torch.randn(N, 1, Lq, D) / 4, torch.randn(N, 1, S, D), torch.randn(N, 1, S, D)
    mask = torch.zeros(1, 1, Lq, S)
    mask[..., :512] = torch.zeros(Lq, 512).masked_fill(torch.ones(Lq, 512, dtype=torch.bool).triu(257), float("-inf"))
    g = torch.randn(N, 1, Lq, D)
    o, lse = flash(q, k, v, attn_mask=mask, scale=D ** -0.5)
    flat = [t.view(N, -1, D) for t in (q, k, v, g, o)]
    a = flash_bwd(g, q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=D ** -0.5)
    m = matmul_backward(*flat, lse, mask.view(1, Lq, S), D ** -0.5)
    print([(x.reshape(-1) - y.reshape(-1)).abs().max().item() for x, y in zip(a, m)])
    timed({f"S={S} flash": lambda: flash_bwd(g, q, k, v, o, lse, 0.0, False, attn_mask=mask, scale=D ** -0.5),
           f"S={S} manual": lambda: matmul_backward(*flat, lse, mask.view(1, Lq, S), D ** -0.5)})
    timed({f"S={S} flash fwd": lambda: flash(q, k, v, attn_mask=mask, scale=D ** -0.5)})


if __name__ == "__main__":
    kvm(int(sys.argv[2])) if sys.argv[1] == "kvm-backward" else ovq(sys.argv[1])
