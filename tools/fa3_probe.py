"""Whether this machine's PyTorch can run FlashAttention-3's FP8 path (per-head descales), and how fast
it is at the production shape next to SDPA in bf16.

    python tools/fa3_probe.py   # on a GPU; prints one JSON object

torch >= 2.11 routes `_scaled_dot_product_attention_quantized` to FA3 once
`torch.nn.attention.activate_flash_attention_impl("FA3")` finds the `flash_attn_interface` package.
"""
import json
import traceback

import torch
import torch.nn.functional as F

from engine.bench import event_ms

dev = torch.device("cuda")
H, M, S, D = 20, 757, 5788, 128
out = {"torch": torch.__version__}
try:
    torch.nn.attention.activate_flash_attention_impl("FA3")
    out["fa3"] = "active"
except Exception as e:  # the package is missing, or this torch has no FA3 registry
    out["fa3"] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
q, k, v = torch.randn(1, H, M, D, device=dev), torch.randn(1, H, S, D, device=dev), torch.randn(1, H, S, D, device=dev)
q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
out["sdpa_bf16_us"] = 1000 * event_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb), dev, 20)
if out["fa3"] == "active":
    try:
        from torch.nn.attention.experimental._scaled_dot_product_attention_quantized import (
            _scaled_dot_product_attention_quantized as fp8_sdpa,
        )

        ones = torch.ones(1, H, device=dev)
        fn = lambda: fp8_sdpa(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones)
        ref = F.scaled_dot_product_attention(q8.float(), k8.float(), v8.float())
        out["fa3_fp8_rel_err"] = ((fn().float() - ref).norm() / ref.norm()).item()
        out["fa3_fp8_us"] = 1000 * event_ms(fn, dev, 20)
    except Exception:
        out["fa3_fp8_error"] = traceback.format_exc()[-800:]
print(json.dumps(out))
