"""GEMM shapes of one 57b rank at TP 3 (M = 757): bf16 vs FP8 row-wise (with and without fast accumulation)
vs FP8 tensor-wise scaling.

    python -m lab.probes.gemm_probe   # on a GPU; prints one JSON object
"""
import json

import torch

from lab.bench import event_ms

dev = torch.device("cuda")
M = 757
shapes = {"qkv": (7680, 7680), "attn_out": (2560, 7680), "mlp_in": (7680, 16384), "mlp_out": (8192, 7680),
          # the parallel block's two input GEMMs share their input: one GEMM over both weights
          "qkv+mlp_in": (7680, 24064),
          # and its two output GEMMs, were they one product over both inputs
          "attn_out+mlp_out": (10752, 7680)}
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M}
for name, (K, N) in shapes.items():
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa, sw = torch.ones(M, 1, device=dev), torch.ones(1, N, device=dev)
    one = torch.ones((), device=dev)
    flop = 2 * M * K * N
    row = {
        "bf16_us": 1000 * event_ms(lambda: a @ w.t(), dev, 20),
        "fp8_rowwise_us": 1000 * event_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16), dev, 20),
        "fp8_rowwise_fast_accum_us": 1000 * event_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16,
                                                                             use_fast_accum=True), dev, 20),
        "fp8_tensorwise_us": 1000 * event_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), dev, 20),
    }
    row.update({k.replace("_us", "_tflops"): flop / v / 1e6 for k, v in list(row.items())})
    out[name] = row
print(json.dumps(out))
