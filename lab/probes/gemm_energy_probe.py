"""Energy and time of one 57b rank's block GEMMs (TP 3, M = 757) and its fused elementwise kernels, each held
back to back at the GPU's power limit as in the served step, beside its time with the clock up.

At the power limit the step's time follows its energy, so a kernel is judged by joules per call there:

    python -m lab.probes.gemm_energy_probe [--seconds 2]   # on a GPU; prints one JSON object
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from lab.bench import graph_call_ms, sustained_energy
from lab.gpu_energy import EnergyMeter
from engine.kernels import FP_FUSION, fused_block
from engine.kernels.fp8_gemm import FP8GEMM
from engine.kernels.fp8_linear import FP8Linear, quantize_rows_reference

M = 757
SHAPES = {"qkv": (7680, 7680), "attn_out": (2560, 7680), "mlp_out": (8192, 7680),
          "attn_out+mlp_out": (10752, 7680)}  # (K, N); the last: the two output GEMMs as one product over both inputs


def weight(K: int, N: int, dev: torch.device, g: torch.Generator, gate_up_block: int = 0) -> FP8Linear:
    lin = nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0.0, K ** -0.5, generator=g)
    return FP8Linear(lin, fast_accum=True, gate_up_block=gate_up_block)


def add_rates(row: dict, flop: int) -> None:
    """TFLOP/s and pJ per FLOP at the power limit for each measured configuration of a row."""
    for v in row.values():
        if "us_per_call" in v:
            v["tflops_at_limit"] = flop / v["us_per_call"] / 1e6
            v["pj_per_flop"] = 1e9 * v["mj_per_call"] / flop


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA"})


def measure(fn, dev, meter, seconds: float) -> dict:
    out = {"us_clock_up": 1000 * graph_call_ms(fn, dev, 10), "kernels": kernel_names(fn)}
    out.update(sustained_energy(fn, dev, meter, seconds=seconds, calls=20))
    if "joules_per_call" in out:
        out["mj_per_call"] = 1000 * out.pop("joules_per_call")
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--no-triton", action="store_true", help="block GEMMs on cuBLAS only")
    p.add_argument("--parts", default="gemm,swiglu,elementwise", help="comma-separated: gemm, swiglu, elementwise")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    from engine.kernels.fp8_linear import prefer_static_gemm_schedule

    prefer_static_gemm_schedule()  # cuBLASLt as the engine runs it (no workspace), before any GEMM in this process
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    meter = EnergyMeter.open(dev)
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "M": M,
                 "power_limit_w": meter.power_limit_w() if meter else None}
    for name, (K, N) in SHAPES.items() if "gemm" in parts else ():
        lin = weight(K, N, dev, g)
        x8, sx = quantize_rows_reference(torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g))
        ref = torch._scaled_mm(x8, lin.weight8.t(), scale_a=sx, scale_b=lin.weight_scale, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
        flop = 2 * M * K * N
        row = {"cublas": measure(lambda: torch._scaled_mm(x8, lin.weight8.t(), scale_a=sx, scale_b=lin.weight_scale,
                                                          out_dtype=torch.bfloat16, use_fast_accum=True), dev, meter, args.seconds)}
        # the same product with M padded to 768 rows (a multiple of the tiles), and transposed (weights as the left
        # operand, y^T (N, 768) out): cuBLAS picks its kernel by shape
        x8p, sxp = torch.zeros(768, K, device=dev, dtype=x8.dtype), torch.ones(768, 1, device=dev)
        x8p[:M], sxp[:M] = x8, sx
        swt, sxt = lin.weight_scale.t().contiguous(), sxp.t().contiguous()
        row["cublas_m768"] = measure(lambda: torch._scaled_mm(x8p, lin.weight8.t(), scale_a=sxp, scale_b=lin.weight_scale,
                                                              out_dtype=torch.bfloat16, use_fast_accum=True), dev, meter, args.seconds)
        yt = torch._scaled_mm(lin.weight8, x8p.t(), scale_a=swt, scale_b=sxt, out_dtype=torch.bfloat16, use_fast_accum=True)
        row["cublas_transposed_m768"] = {**measure(lambda: torch._scaled_mm(lin.weight8, x8p.t(), scale_a=swt, scale_b=sxt,
                                                                            out_dtype=torch.bfloat16, use_fast_accum=True),
                                                   dev, meter, args.seconds), "rel_err_vs_cublas": rel(yt.t()[:M], ref)}
        for bn, stages, warps in () if args.no_triton else ((128, 4, 8), (256, 3, 8), (128, 5, 8)):
            key = f"triton_bn{bn}_s{stages}_w{warps}"
            try:
                k = FP8GEMM(lin.weight8, lin.weight_scale, block_n=bn, stages=stages, num_warps=warps)
                err = rel(k(x8, sx), ref)
                row[key] = {**measure(lambda: k(x8, sx), dev, meter, args.seconds), "rel_err_vs_cublas": err}
            except Exception as e:  # a configuration that does not fit (shared memory, registers)
                row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        add_rates(row, flop)
        res[name] = row
        print(json.dumps({name: row}), flush=True)

    K, H = 7680, 8192
    if "swiglu" in parts:
        mlp_in_variants(res, dev, g, meter, args.seconds, K, H)
    if "elementwise" in parts:
        elementwise(res, dev, g, meter, args.seconds, H)
    print(json.dumps(res))


def mlp_in_variants(res, dev, g, meter, seconds, K, H) -> None:
    """MLP-in as served (Triton, SwiGLU in the epilogue) and its variants."""
    lin = weight(K, 2 * H, dev, g, gate_up_block=128)  # gate and up rows interleaved, as the SwiGLU form reads them
    x8, sx = quantize_rows_reference(torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g))
    flop = 2 * M * K * 2 * H
    row = {}
    ref = None
    for stages, gm in ((3, 8), (4, 8), (3, 6)):
        k = FP8GEMM(lin.weight8, lin.weight_scale, swiglu=True, block_n=128, stages=stages, group_m=gm)
        y = k(x8, sx)
        ref = y if ref is None else ref
        row[f"swiglu_s{stages}_g{gm}"] = {**measure(lambda: k(x8, sx), dev, meter, seconds), "rel_err": rel(y, ref)}
    add_rates(row, flop)
    res["mlp_in_swiglu"] = row
    print(json.dumps({"mlp_in_swiglu": row}), flush=True)


def elementwise(res, dev, g, meter, seconds, H) -> None:
    """The block's residual sum + next LayerNorm + FP8 kernel and the row quantisation of MLP-in's output, at the
    step's shapes, by warps (the engine launches them with 8)."""
    from engine.kernels.fp8_linear import _quant_rows_kernel

    D = 7680
    a, m, x = (torch.randn(M, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
    ga, gmm, sh, sc = (0.1 * torch.randn(D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    s = torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=g)
    y, h8, shh = torch.empty_like(x), torch.empty(M, D, device=dev, dtype=torch.float8_e4m3fn), torch.empty(M, 1, device=dev)
    s8, ss = torch.empty(M, H, device=dev, dtype=torch.float8_e4m3fn), torch.empty(M, 1, device=dev)
    row = {}
    for warps in (4, 8, 16):
        def gsum(warps=warps):
            fused_block._gated_sum_ln_quant_kernel[(M,)](a, m, ga, gmm, x, y, sh, sc, h8, shh, D, 1e-6, BLOCK_K=8192,
                                                         EXACT=False, PDL=False, num_warps=warps, **FP_FUSION)

        def qrows(warps=warps):
            _quant_rows_kernel[(M,)](s, s8, ss, H, H, BLOCK_K=8192, EXACT=False, PDL=False, num_warps=warps, **FP_FUSION)
        row[f"gated_sum_ln_quant_w{warps}"] = measure(gsum, dev, meter, seconds)
        row[f"quant_rows_w{warps}"] = measure(qrows, dev, meter, seconds)
    res["elementwise"] = row
    print(json.dumps({"elementwise": row}), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
