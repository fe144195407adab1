"""Diagnostics for the FP8 attention kernel on a GPU: tensor-core instructions in its PTX, and one timing."""
import json, statistics, sys, torch, triton
from engine import fp8
from engine.kernels.fp8_attention import FP8Attention, qk_scale, _attn_kernel
from engine.bench import time_ms
dev = torch.device("cuda")
H, M, S, D = 20, 757, 5788, 128
sc = fp8.per_head_scale(torch.ones(H, D, device=dev))
q8 = fp8.quantize(torch.randn(H, M, D, device=dev), sc); k8 = fp8.quantize(torch.randn(H, S, D, device=dev), sc)
vt8 = fp8.quantize(torch.randn(H, S, D, device=dev), sc).transpose(1, 2).contiguous()
valid = torch.ones(S, dtype=torch.int8, device=dev); out = torch.empty(M, H * D, device=dev, dtype=torch.bfloat16)
att = FP8Attention(H, M, S, D, dev)
att(q8, k8, vt8, valid, qk_scale(sc, sc, D), sc, out)
ms = statistics.median(time_ms(lambda: att(q8, k8, vt8, valid, qk_scale(sc, sc, D), sc, out), dev, 20))
k = list(_attn_kernel.device_caches[0][0].values())[0] if hasattr(_attn_kernel, "device_caches") else None
info = {"us": ms * 1000}
if k is not None:
    ptx = k.asm.get("ptx", "")
    info.update(wgmma=ptx.count("wgmma"), mma=ptx.count("mma.sync"), n_regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None), shared=getattr(k, "metadata", None) and k.metadata.shared)
print(json.dumps(info))
