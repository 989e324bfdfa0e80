"""FlexAttention (block mask) vs packed SDPA for KVM's attention pattern on CPU, forward + backward.

T = 8192, chunk_len 256, state 256 rows, 2 window chunks, 2 heads x 128; full causal SDPA for reference.
Packed SDPA: every chunk's queries against [its state snapshot ; its window], chunks as the batch.
FlexAttention: one call over [all snapshots ; all tokens] with a block mask (compiled).

    OMP_NUM_THREADS=2 python benchmarks/bench_kvm_flex.py
"""
import time, torch, torch.nn.functional as F
torch.manual_seed(0)
B,H,T,C,D,m,nb = 1,2,8192,256,128,256,2
nQ=T//C; L=nb*C; Ks=m+L
def timeit(fn, n=3):
    fn(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return min(ts)
q=torch.randn(B,H,nQ,C,D,requires_grad=True); k=torch.randn(B,H,nQ,Ks,D,requires_grad=True); v=torch.randn(B,H,nQ,Ks,D,requires_grad=True)
qp=torch.arange(C)[:,None]+L-C; kp=torch.arange(L)[None]
mask=torch.cat([torch.ones(C,m,dtype=torch.bool), kp<=qp],1)
def packed():
    o=F.scaled_dot_product_attention(q.view(B*H,nQ,C,D),k.view(B*H,nQ,Ks,D),v.view(B*H,nQ,Ks,D),attn_mask=mask)
    o.sum().backward()
print("packed sdpa bool mask", timeit(packed))
def packed_float():
    mf=torch.zeros(C,Ks).masked_fill(~mask,float('-inf'))
    o=F.scaled_dot_product_attention(q.view(B*H,nQ,C,D),k.view(B*H,nQ,Ks,D),v.view(B*H,nQ,Ks,D),attn_mask=mf)
    o.sum().backward()
print("packed sdpa float mask", timeit(packed_float))
qf=torch.randn(B,H,T,D,requires_grad=True); kf=torch.randn(B,H,T,D,requires_grad=True); vf=torch.randn(B,H,T,D,requires_grad=True)
def full():
    o=F.scaled_dot_product_attention(qf,kf,vf,is_causal=True); o.sum().backward()
print("full causal", timeit(full,2))
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
# keys: [all snapshots (nQ*m) ; tokens (T)]
NK=nQ*m+T
kk=torch.randn(B,H,NK,D,requires_grad=True); vv=torch.randn(B,H,NK,D,requires_grad=True)
S0=nQ*m
def mm(b,h,qi,ki):
    c=qi//C
    in_state=(ki<S0)&(ki//m==c)
    kt=ki-S0
    in_win=(ki>=S0)&(kt<=qi)&(kt//C>c-nb)
    return in_state|in_win
t=time.perf_counter()
bm=create_block_mask(mm,None,None,T,NK,device='cpu',BLOCK_SIZE=128)
print("block mask", time.perf_counter()-t)
fa=torch.compile(flex_attention)
def flex():
    o=fa(qf,kk,vv,block_mask=bm); o.sum().backward()
try:
    t=time.perf_counter(); flex(); print("flex first (compile)", time.perf_counter()-t)
    print("flex", timeit(flex))
except Exception as e:  # torch 2.13 CPU: no FlexAttention backward
    print("flex: failed:", type(e).__name__, str(e)[:200])
