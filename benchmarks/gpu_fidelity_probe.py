"""GPU facts the cost model needs, measured: bf16 GEMMs at the published runs' local shapes,
torchtitan's eager fp32 RMSNorm and complex RoPE, and what a sustained GEMM settles at (power, clock).

    python benchmarks/gpu_fidelity_probe.py > probe.txt     # on one CUDA GPU, ~45 s; prints JSON<...>
    python benchmarks/gpu_fidelity_probe.py --report benchmarks/gpu_fidelity_probe_h100.json   # anywhere

The measuring part below is, statement for statement, what ran on the device on 2026-11-25 (one
NVIDIA H100 80GB HBM3, power limit 700 W, torch 2.11.0+cu130; output in
``benchmarks/gpu_fidelity_probe_h100.json``): each GEMM ``x[M,K] @ W[N,K]^T`` timed as the mean of 10
after 3 warm-ups, the backward's two GEMMs of the 8B recipe's w1, Megatron 2021's batched QK^T, the
eager ops at the 8B recipe's shapes (RoPE over q and k as one 40-head tensor), a 2 GiB copy, then
30 one-second windows of back-to-back 8192^3 GEMMs with ``nvidia-smi`` sampling power draw, power
limit, SM clock and temperature each second. On a machine without CUDA it runs shrunk shapes (a
smoke test; no nvidia-smi there, so it stops at the sustained loop).

``--report`` prints each GEMM next to ``passes/cost/kernels.py``'s price on the ``h100`` preset and
the eager ops next to the byte counts of ``passes/cost/kernel_classes.py`` (whose class rates they set).
"""
import sys

if "--report" in sys.argv:
    import json
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from autoshard.passes.cost.hardware import PRESETS
    from autoshard.passes.cost.kernel_classes import PROBE_RMSNORM_BYTES, PROBE_ROPE_BYTES
    from autoshard.passes.cost.kernels import gemm_efficiency, gemm_seconds, memory_seconds
    d = json.load(open(sys.argv[sys.argv.index("--report") + 1]))
    hw = PRESETS["h100"]
    print(f"{d['dev']}, torch {d['torch']}; priced on the h100 preset (gemm_efficiency {hw.gemm_efficiency})")
    for kind, B, M, N, K, s in d["gemm"]:
        f = 2.0 * B * M * N * K
        print(f"{kind:5s} {B:4d} x {M:6d} {N:6d} {K:6d}: {f / s / 1e12:6.1f} TFLOP/s ({f / s / hw.flops_bf16:.3f} of peak); "
              f"model {gemm_efficiency(hw, B, M, N, K):.3f}, predicted / measured {gemm_seconds(hw, B, M, N, K) / s:.3f}")
    per_elem = {"norm_f": PROBE_RMSNORM_BYTES, "norm_fb": 3 * PROBE_RMSNORM_BYTES, "rope_f": PROBE_ROPE_BYTES,
                "rope_fb": 3 * PROBE_ROPE_BYTES}
    for op, n, s in d["eager"]:
        moved = n if op == "copy" else per_elem[op] * n
        print(f"{op:8s} {s * 1e3:.3f} ms: {moved / s / 1e12:.2f} TB/s at the modelled bytes, "
              f"predicted / measured {memory_seconds(hw, moved) / s:.3f}")
    w = d["sus"]
    print(f"sustained 8192^3 GEMM, {len(w)} one-second windows: first {w[0] / 1e12:.1f}, mean {sum(w) / len(w) / 1e12:.1f}, "
          f"min {min(w) / 1e12:.1f} TFLOP/s")
    print("nvidia-smi each second (power W, limit W, SM MHz, C):", "; ".join(x for x in d["smi"] if x))
    sys.exit(0)

import torch,time,json,subprocess as sp
C=torch.cuda.is_available();d='cuda'if C else'cpu';b=torch.bfloat16;S=torch.cuda.synchronize if C else lambda:0;z=1 if C else 64
def T(f,r=10):
 for _ in range(3):f()
 S();t=time.perf_counter()
 for _ in range(r):f()
 S();return (time.perf_counter()-t)/r
R={'dev':torch.cuda.get_device_name()if C else d,'torch':torch.__version__,'gemm':[],'eager':[]}
for M,N,K in [(32768,6912,2304),(32768,2304,2304),(32768,9216,2304),(32768,2304,9216),(4096,3840,10240),(4096,10240,1280),(4096,5120,10240),(4096,10240,5120),(2048,9600,25600),(2048,25600,3200),(2048,12800,25600),(2048,25600,12800),(16384,4096,4096),(16384,1024,4096),(16384,14336,4096),(16384,4096,14336),(16384,128256,4096),(8192,28672,8192),(8192,8192,28672),(16384,2048,16384),(16384,6656,16384),(16384,16384,6656)]:
 M,N,K=M//z,N//z,K//z;x=torch.randn(M,K,device=d,dtype=b);w=torch.randn(N,K,device=d,dtype=b)
 R['gemm'].append(['fwd',1,M,N,K,T(lambda:x@w.t())])
x=torch.randn(16384,4096,device=d,dtype=b);w=torch.randn(14336,4096,device=d,dtype=b);g=torch.randn(16384,14336,device=d,dtype=b)
R['gemm']+=[['dgrad',1,16384,4096,14336,T(lambda:g@w)],['wgrad',1,14336,4096,16384,T(lambda:g.t()@x)]]
q=torch.randn(384,2048,96,device=d,dtype=b);k=torch.randn(384,96,2048,device=d,dtype=b)
R['gemm'].append(['bmm',384,2048,2048,96,T(lambda:torch.bmm(q,k))])
W=torch.ones(4096,device=d,dtype=b,requires_grad=True)
def nrm(x):
 f=x.float();return (f*torch.rsqrt(f.pow(2).mean(-1,keepdim=True)+1e-5)).type_as(x)*W
X=torch.randn(2,8192,4096,device=d,dtype=b,requires_grad=True);G=torch.randn_like(X)
R['eager']+=[['norm_f',X.numel(),T(lambda:nrm(X))],['norm_fb',X.numel(),T(lambda:torch.autograd.grad(nrm(X),(X,W),G))]]
fr=torch.polar(torch.ones(8192,64,device=d),torch.randn(8192,64,device=d)).view(1,8192,1,64)
def rp(a):return torch.view_as_real(torch.view_as_complex(a.float().reshape(*a.shape[:-1],-1,2))*fr).flatten(3).type_as(a)
Q=torch.randn(2,8192,40,128,device=d,dtype=b,requires_grad=True);GQ=torch.randn_like(Q)
R['eager']+=[['rope_f',Q.numel(),T(lambda:rp(Q))],['rope_fb',Q.numel(),T(lambda:torch.autograd.grad(rp(Q),Q,GQ))]]
s=torch.randn(2**28,device=d,dtype=b);o=torch.empty_like(s)
R['eager'].append(['copy',4*s.numel(),T(lambda:o.copy_(s))])
a=torch.randn(8192,8192,device=d,dtype=b);c=torch.randn_like(a)
p=sp.Popen(['nvidia-smi','--query-gpu=power.draw,power.limit,clocks.sm,temperature.gpu','--format=csv,noheader,nounits','-lms','1000'],stdout=sp.PIPE,text=True)
V=[]
for i in range(30//z+1):
 t=time.perf_counter()
 for _ in range(700//z):a@c
 S();V.append(2*8192**3*700/(time.perf_counter()-t))
p.terminate();R['sus']=V;R['smi']=p.stdout.read().split('\n')
print('JSON'+json.dumps(R))
