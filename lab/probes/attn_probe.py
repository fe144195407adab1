"""The FP8 attention kernel at the production shape under given options: time per call, and what the
compiler made of it (tensor-core and shared-memory instructions in the PTX, registers, spills). Each call is
timed as a CUDA graph of 20 calls, as `lab.bench attention` times them.

    python -m lab.probes.attn_probe '[{"block_n": 64, "tma": true}, {"block_m": 128, "block_n": 128, "num_warps": 8}]'   # on a GPU
    python -m lab.probes.attn_probe '[{"kernel": "ws", "block_n": 128, "stages": 3}]'   # the warp-specialised kernel

The first line printed is SDPA in bf16 over the same (live) slots, for scale.
"""
import json
import sys

import torch

from engine import fp8
from lab.bench import graph_call_ms, rms_heads
from engine.kernels import make_attention
from engine.kernels.fp8_attention import _attn_kernel, attention_reference, qk_scale

dev = torch.device("cuda")
H, M, S, D = 20, 757, 5824, 128
live = 5788
g = torch.Generator(device=dev).manual_seed(0)
rms = lambda *shape: rms_heads(g, *shape)
sc = fp8.per_head_scale(torch.ones(H, D, device=dev))
q8, k8 = fp8.quantize(rms(H, M, D), sc), fp8.quantize(rms(H, S, D), sc)
vt8 = fp8.quantize(rms(H, S, D), sc).transpose(1, 2).contiguous()
valid = torch.zeros(S, dtype=torch.int8, device=dev)
valid[:live] = 1
out = torch.empty(M, H * D, device=dev, dtype=torch.bfloat16)
qks = qk_scale(sc, sc, D)
ref = attention_reference(q8, k8, vt8, valid, sc, sc, sc)


def compiled() -> list:
    """The attention kernel's variants compiled so far (Triton's cache for this device)."""
    return list(_attn_kernel.device_caches[0][0].values()) if hasattr(_attn_kernel, "device_caches") else []


qb, kb, vb = (x.float().bfloat16()[None] for x in (q8, k8[:, :live], vt8.transpose(1, 2)[:, :live]))
sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
print(json.dumps({"kernel": "sdpa_bf16", "us": 1000 * graph_call_ms(sdpa, dev, 10)}), flush=True)

for opts in json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]:
    row = dict(opts)
    try:
        opts = dict(opts)
        kernel = opts.pop("kernel", "triton")
        att = make_attention(kernel, H, M, S, D, dev, **opts)
        att.mark_live_tiles(valid)
        before = compiled()
        vt = att.arrange_v(vt8)
        fn = lambda: att(q8, k8, vt, valid, qks, sc, out)
        row["us"] = 1000 * graph_call_ms(fn, dev, 10)
        row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
        new = [k for k in compiled() if k not in before]
        if new:
            ptx = new[0].asm.get("ptx", "")
            row.update(wgmma=ptx.count("wgmma.mma_async"), wgmma_wait=ptx.count("wgmma.wait_group"),
                       st_shared=ptx.count("st.shared"), ld_shared=ptx.count("ld.shared"), ex2=ptx.count("ex2.approx"),
                       n_regs=getattr(new[0], "n_regs", None), spills=getattr(new[0], "n_spills", None))
    except Exception as e:  # a configuration the compiler rejects
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
