"""What a bf16 GEMM loop settles at on one GPU once its power limit binds: the first 20 products'
rate, then 30 one-second windows of back-to-back 8192^3 products, with nvidia-smi sampling power,
power limit, SM clock and temperature each second. Prints JSON<...>.

    python benchmarks/gpu_sustained_gemm.py                 # on one CUDA GPU, ~35 s

Run as is on one NVIDIA H200 (700 W limit, torch 2.11.0+cu130) on 2026-11-25; output in
``benchmarks/gpu_sustained_gemm_h200.json`` (the h200 preset's ``gemm_efficiency`` cites it). The
H100 figure comes from the same loop inside ``benchmarks/gpu_fidelity_probe.py``.
"""
import torch,time,json,subprocess as sp
S=torch.cuda.synchronize;b=torch.bfloat16
a=torch.randn(8192,8192,device='cuda',dtype=b);c=torch.randn_like(a)
for _ in range(5):a@c
S()
p=sp.Popen(['nvidia-smi','--query-gpu=power.draw,power.limit,clocks.sm,temperature.gpu','--format=csv,noheader,nounits','-lms','1000'],stdout=sp.PIPE,text=True)
t=time.perf_counter()
for _ in range(20):a@c
S();first=2*8192**3*20/(time.perf_counter()-t)
V=[]
for i in range(30):
 t=time.perf_counter()
 for _ in range(700):a@c
 S();V.append(2*8192**3*700/(time.perf_counter()-t))
p.terminate()
print('JSON'+json.dumps({'dev':torch.cuda.get_device_name(),'torch':torch.__version__,'first':first,'sus':V,'smi':p.stdout.read().split('\n')}))
