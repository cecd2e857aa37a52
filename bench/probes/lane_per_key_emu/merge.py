import numpy as np
from emu import *
def split(kv,g,pos,start):
    nkeys=pos+1-start; n=min(min(32,max(1,g//kv)),(nkeys+63)//64); n=max(n,1)
    per=(nkeys+n-1)//n; return (nkeys+per-1)//per, per
rng=np.random.default_rng(7); G=4
for pos,start,kv,g in [(16000,0,8,132),(4095,0,8,132),(300,0,8,132),(100,0,8,132),(16383,0,1,132)]:
    ns,per=split(kv,g,pos,start)
    K=bf(rng.standard_normal((pos+1,D))*2); V=bf(rng.standard_normal((pos+1,D))); Q=bf(rng.standard_normal((G,D)))
    sc=f32(1/np.sqrt(D)); parts=[]
    for sp in range(ns):
        j0=start+sp*per; j1=min(j0+per,pos+1)
        parts.append(block_new(Q,K,V,j0,j1,sc,G))
    out=np.zeros((G,D),f32)
    for gg in range(G):
        for d in range(D):
            mx=NEG; num=f32(0); den=f32(0)
            for (a,m,l) in parts:
                mn=np.fmax(mx,m[gg]); cold=expf(mx-mn); cq=expf(m[gg]-mn)
                num=fma(a[gg,d],cq,mul(num,cold)); den=fma(l[gg],cq,mul(den,cold)); mx=mn
            out[gg,d]=num/den
    r=ref(Q,K,V,start,pos+1,sc)
    print(pos,ns,per,"rel err",abs(out-r).max()/abs(r).max())
