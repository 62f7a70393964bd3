"""torchtitan's eager Llama-3-8B decoder layer and PyTorch SDPA's causal attention, measured on one GPU,
next to what the planner's per-op prices (``passes/cost``) predict for them.

    python benchmarks/gpu_layer_probe.py > probe.txt         # on one CUDA GPU (~20 s); prints JSON<...>
    python benchmarks/gpu_layer_probe.py --report benchmarks/gpu_layer_probe_h100.json   # anywhere

The measuring part below is, statement for statement, what ran on the device on 2026-11-25 (one
NVIDIA H100 80GB HBM3, 700 W limit, torch 2.11.0+cu130; output in ``benchmarks/gpu_layer_probe_h100.json``):
8 s of back-to-back 8192^3 GEMMs first (the card at its power limit, as in a running job), then one
decoder layer written as torchtitan 9dec370 writes it (fp32 RMSNorm, separate wq/wk/wv, complex
RoPE, repeat_kv, SDPA causal, SwiGLU; bf16 weights, batch 2 x 8192, no activation checkpointing)
forward and forward + backward, and SDPA alone at 32 and 16 heads (the 8B layer, the 405B layer's
local heads under TP 8), each the mean of 10 after 3 warm-ups. Twice: with SDPA held to its flash
kernel (FlashAttention-2, first in SDPA's default priority, what torchtitan's eager runs used), and
with cuDNN attention put first (the keys ending in ``_default``: not SDPA's default, a mislabel kept
so the file matches the run). ``nvidia-smi`` samples power, SM clock and temperature each second.
"""
import sys

if "--report" in sys.argv:
    import dataclasses
    import json
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import literature as lit
    from torchtitan_llama_2024 import layer_probe_seconds
    d = json.load(open(sys.argv[sys.argv.index("--report") + 1]))
    hw = lit.HARDWARE["h100"]
    print(f"{d['dev']}, torch {d['torch']}; h100 preset: gemm_efficiency {hw.gemm_efficiency:.3f}, "
          f"attention_efficiency {hw.attention_efficiency} (flash kernel: {lit.TORCH_2024_FLASH_ATTENTION_H100}); "
          "predicted: the planner's per-op prices (GraphFacts) of the same program")
    for key, att, bwd in (("flash", lit.TORCH_2024_FLASH_ATTENTION_H100, lit.TORCH_2024_FLASH_BACKWARD_FACTOR),
                          ("default", hw.attention_efficiency, hw.attention_backward_factor)):
        fwd, both = layer_probe_seconds(dataclasses.replace(hw, attention_efficiency=att, attention_backward_factor=bwd))
        print(f"torchtitan 8B layer, 2 x 8192 tokens, SDPA {key}: forward {d['layer_fwd_' + key] * 1e3:.2f} ms "
              f"measured, {fwd * 1e3:.2f} predicted; forward + backward {d['layer_fwdbwd_' + key] * 1e3:.2f} "
              f"measured, {both * 1e3:.2f} predicted")
    for heads in (32, 16):
        flops = 4.0 * 2 * heads * 8192 * 8192 * 128 * 0.5   # causal: half the score blocks
        for kernel, key in (("flash (FA2)", "flash"), ("cuDNN first", "default")):
            f, fb = d[f"sdpa{heads}_fwd_{key}"], d[f"sdpa{heads}_fwdbwd_{key}"]
            print(f"SDPA causal {heads} heads, {kernel}: forward {flops / f / hw.flops_bf16:.3f} of peak, "
                  f"backward {2.5 * flops / (fb - f) / hw.flops_bf16:.3f}")
    print("nvidia-smi each second (power W, SM MHz, C):", "; ".join(x for x in d["smi"] if x))
    sys.exit(0)
import torch,time,json,subprocess as sp
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel,SDPBackend
C=torch.cuda.is_available();d='cuda'if C else'cpu';b=torch.bfloat16;S=torch.cuda.synchronize if C else lambda:0
z=1 if C else 64
B,T,H,NH,KV,FF=2,8192//z,4096//z,32,8,14336//z
HD=H//NH
def tm(f,r=10,w=3):
 for _ in range(w):f()
 S();t=time.perf_counter()
 for _ in range(r):f()
 S();return (time.perf_counter()-t)/r
R={'dev':torch.cuda.get_device_name()if C else d,'torch':torch.__version__}
p=sp.Popen(['nvidia-smi','--query-gpu=power.draw,clocks.sm,temperature.gpu','--format=csv,noheader,nounits','-lms','1000'],stdout=sp.PIPE,text=True)if C else None
a=torch.randn(8192//z,8192//z,device=d,dtype=b)
t=time.perf_counter()
while time.perf_counter()-t<8:
 for _ in range(100):a@a
 S()
def lin(i,o):return torch.randn(o,i,device=d,dtype=b,requires_grad=True)/i**.5
Wq,Wk,Wv,Wo=lin(H,H),lin(H,KV*HD),lin(H,KV*HD),lin(H,H)
W1,W3,W2=lin(H,FF),lin(H,FF),lin(FF,H)
n1=torch.ones(H,device=d,dtype=b,requires_grad=True);n2=torch.ones(H,device=d,dtype=b,requires_grad=True)
ang=torch.randn(T,HD//2,device=d)
fr=torch.polar(torch.ones_like(ang),ang).view(1,T,1,HD//2)
def nrm(x,w):
 f=x.float();return (f*torch.rsqrt(f.pow(2).mean(-1,keepdim=True)+1e-5)).type_as(x)*w
def rp(x):return torch.view_as_real(torch.view_as_complex(x.float().reshape(*x.shape[:-1],-1,2))*fr).flatten(3).type_as(x)
def rep(x):
 bs,sl,nk,hd=x.shape;return x[:,:,:,None,:].expand(bs,sl,nk,NH//KV,hd).reshape(bs,sl,NH,hd)
def layer(x):
 y=nrm(x,n1);q=(y@Wq.t()).view(B,T,NH,HD);k=(y@Wk.t()).view(B,T,KV,HD);v=(y@Wv.t()).view(B,T,KV,HD)
 q,k=rp(q),rp(k);k,v=rep(k),rep(v)
 o=F.scaled_dot_product_attention(q.transpose(1,2),k.transpose(1,2),v.transpose(1,2),is_causal=True)
 h=x+o.transpose(1,2).contiguous().view(B,T,H)@Wo.t()
 y=nrm(h,n2);return h+(F.silu(y@W1.t())*(y@W3.t()))@W2.t()
x=torch.randn(B,T,H,device=d,dtype=b,requires_grad=True);g=torch.randn_like(x)
ps=[x,Wq,Wk,Wv,Wo,W1,W3,W2,n1,n2]
for name,bk in (('flash',SDPBackend.FLASH_ATTENTION),('default',None)):
 ctx=(lambda:sdpa_kernel(bk))if bk else(lambda:sdpa_kernel([SDPBackend.CUDNN_ATTENTION,SDPBackend.FLASH_ATTENTION,SDPBackend.EFFICIENT_ATTENTION,SDPBackend.MATH]))
 with ctx():
  R['layer_fwd_'+name]=tm(lambda:layer(x))
  R['layer_fwdbwd_'+name]=tm(lambda:torch.autograd.grad(layer(x),ps,g))
  for nh in (32,16):
   q=torch.randn(B,nh,T,HD,device=d,dtype=b,requires_grad=True);k=torch.randn_like(q,requires_grad=True);v=torch.randn_like(q,requires_grad=True);go=torch.randn_like(q)
   R[f'sdpa{nh}_fwd_'+name]=tm(lambda:F.scaled_dot_product_attention(q,k,v,is_causal=True))
   R[f'sdpa{nh}_fwdbwd_'+name]=tm(lambda:torch.autograd.grad(F.scaled_dot_product_attention(q,k,v,is_causal=True),(q,k,v),go))
if p:p.terminate();R['smi']=p.stdout.read().split('\n')
print('JSON'+json.dumps(R))
