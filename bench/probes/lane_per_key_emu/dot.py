import numpy as np
from emu import *
rng=np.random.default_rng(3); D=128
en=[];eo=[]
for t in range(3000):
    q=bf(rng.standard_normal(D)*3); k=bf(rng.standard_normal(D)*3)
    k[:4]=bf(k[:4]*10); q[:4]=bf(q[:4]*10)  # a few outlier dims
    ex=float(q.astype(np.float64)@k.astype(np.float64)); s=float(np.abs(q.astype(np.float64)*k).sum())
    dn=f32(0)
    for d in range(D): dn=fma(q[d],k[d],dn)
    qq=q.reshape(32,4);kk=k.reshape(32,4); do=mul(qq[:,0],kk[:,0])
    for i in (1,2,3): do=fma(qq[:,i],kk[:,i],do)
    do=warpsum(do)[0]
    en.append(abs(float(dn)-ex)/s); eo.append(abs(float(do)-ex)/s)
print("score err / sum|q_i k_i|: new mean %.2e max %.2e ; old mean %.2e max %.2e"%(np.mean(en),np.max(en),np.mean(eo),np.max(eo)))
