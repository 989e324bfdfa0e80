"""Row reads and adds at OVQ's merge shapes (2 heads, 2,048-row dictionary, 128-token chunk, 2 threads): the
element-wise gather / scatter_add against index_select / index_add_ on a row view (median us; session 17)."""
import torch, time
torch.set_num_threads(2)
B,H,n,D,L=1,2,2048,128,128
d=torch.randn(B,H,n,D); x=torch.randn(B,H,L,D)
assign=torch.randint(0,n,(B,H,L))
idx=assign[...,None].expand(B,H,L,D)
w=torch.rand(B,H,L,1)
def t(f,r=200):
    for _ in range(10): f()
    ts=[]
    for _ in range(r):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1e6
flat=(torch.arange(B*H)[:,None]*n+assign.view(B*H,L)).view(-1)
print("gather", t(lambda: d.gather(2,idx)))
print("index_select", t(lambda: d.view(-1,D).index_select(0,flat).view(B,H,L,D)))
print("cat", t(lambda: torch.cat([d,x],dim=2)))
nd=torch.cat([d,x],dim=2)
print("scatter_add_", t(lambda: nd.scatter_add_(2,idx,w*x)))
print("index_add_", t(lambda: nd.view(-1,D).index_add_(0,(torch.arange(B*H)[:,None]*(n+L)+assign.view(B*H,L)).view(-1),(w*x).view(-1,D))))
g=torch.randn(B,H,n+L,D)
keep=torch.rand(B,H,n+L)
print("g*keep", t(lambda: g[:,:,:n]*keep[:,:,:n,None]))
print("clone", t(lambda: g.clone()))
bi=torch.arange(B)[:,None,None]; hi=torch.arange(H)[None,:,None]
print("adv index", t(lambda: d[bi,hi,assign]))
print("index_put_ acc", t(lambda: nd.index_put_((bi,hi,assign),(w*x),accumulate=True)))
xs=torch.randn(B,H,4096,D)[:,:,128:256]
print("reshape noncontig", t(lambda: xs.reshape(-1,D)))
print("adv index noncontig", t(lambda: xs[bi,hi,assign%128]))
