"""cuBLASLt's candidate algorithms for one 57b rank's block GEMMs (TP 3, M = 757), each judged by energy a
call held back to back at the GPU's power limit, as the served step runs them, and by time with the clock up.

torch._scaled_mm runs the heuristic's first candidate (rank 0; the heuristic ranks by time with the clock up and
offers one at these shapes); beside it every configuration cuBLASLt accepts without a workspace over its large
tiles, stages, custom options and clusters (ranks 100 on), each checked against torch._scaled_mm's product, timed
with the clock up, and the fastest held at the power limit (lab/probes/cublaslt.py calls cuBLASLt):

    python -m lab.probes.cublaslt_algo_probe [--seconds 1.5] [--energy-top 8]   # on a GPU; its last line: one JSON object
"""
from __future__ import annotations

import argparse
import json

import torch

from lab.bench import graph_call_ms
from lab.gpu_energy import EnergyMeter
from engine.kernels.fp8_linear import quantize_rows_reference
from lab.probes import cublaslt
from lab.probes.gemm_energy_probe import M, add_rates, kernel_names, measure, rel, weight

SHAPES = {"qkv": (7680, 7680), "attn_out": (2560, 7680), "mlp_out": (8192, 7680), "mlp_in": (7680, 16384)}  # (K, N)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--count", type=int, default=16, help="candidates asked of the heuristic per shape")
    p.add_argument("--energy-top", type=int, default=8, help="candidates held at the power limit: the fastest by clock-up time")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--no-enumerate", dest="enumerate", action="store_false",
                   help="the heuristic's candidates only (it offers one at these shapes)")
    args = p.parse_args()
    from engine.kernels.fp8_linear import prefer_static_gemm_schedule

    prefer_static_gemm_schedule()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    meter = EnergyMeter.open(dev)
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "cublaslt": cublaslt.version(), "M": M,
                 "power_limit_w": meter.power_limit_w() if meter else None}
    for name in args.shapes.split(","):
        res[name] = probe_shape(*SHAPES[name], dev, g, meter, args)
        print(json.dumps({name: res[name]}), flush=True)
    print(json.dumps(res))


def probe_shape(K: int, N: int, dev: torch.device, g: torch.Generator, meter: EnergyMeter | None,
                args: argparse.Namespace) -> dict:
    """Every candidate at one shape: its error against torch._scaled_mm, time with the clock up, kernel; the
    fastest held at the power limit."""
    lin = weight(K, N, dev, g)
    x8, sx = quantize_rows_reference(torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g))
    sw = lin.weight_scale.reshape(-1).contiguous()
    ref = torch._scaled_mm(x8, lin.weight8.t(), scale_a=sx, scale_b=lin.weight_scale, out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    mm = cublaslt.ScaledMatmul(M, K, N, fast_accum=True)
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    row: dict = {}
    timed = []
    mm.bind_scales(sx, sw)
    heuristic = mm.algorithms(args.count)
    found = [a for a in mm.enumerate() if a.config != heuristic[0].config] if args.enumerate else []
    for i, a in enumerate(found):
        a.rank = 100 + i  # enumerated configurations: not ranked by the heuristic
    for algo in heuristic + found:
        key = f"rank{algo.rank}"
        entry = {"config": algo.config, "waves": algo.waves}
        try:
            y = mm(x8, sx, lin.weight8, sw, algo, out)
            entry["rel_err_vs_scaled_mm"] = rel(y, ref)
            entry["us_clock_up"] = 1000 * graph_call_ms(lambda a=algo: mm(x8, sx, lin.weight8, sw, a, out), dev, 5)
            if entry["rel_err_vs_scaled_mm"] < 1e-2:  # the same product (fast accumulation differs by tile order only)
                timed.append((entry["us_clock_up"], algo))
        except Exception as e:  # a candidate cuBLASLt offers but cannot run here
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row[key] = entry
    held = {a.rank for _, a in sorted(timed, key=lambda t: t[0])[:args.energy_top]} | {0}
    row["scaled_mm"] = measure(lambda: torch._scaled_mm(x8, lin.weight8.t(), scale_a=sx, scale_b=lin.weight_scale,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True), dev, meter, args.seconds)
    for _, algo in timed:
        if algo.rank in held:
            row[f"rank{algo.rank}"]["kernels"] = kernel_names(lambda a=algo: mm(x8, sx, lin.weight8, sw, a, out))
            row[f"rank{algo.rank}"].update(measure(lambda a=algo: mm(x8, sx, lin.weight8, sw, a, out), dev, meter, args.seconds))
    add_rates(row, 2 * M * K * N)
    row["enumerated"] = len(found)
    # what the heuristic would offer with a workspace (the engine runs none): configurations only
    row["with_workspace_32mib"] = [{"config": a.config, "waves": a.waves, "workspace_bytes": a.workspace_bytes}
                                   for a in mm.algorithms(args.count, workspace_bytes=32 << 20)]
    return row


if __name__ == "__main__":
    with torch.no_grad():
        main()
