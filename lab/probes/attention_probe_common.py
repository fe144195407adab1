"""What the probes of other libraries' FP8 attention share (lab/probes/cudnn_attention_probe.py,
lab/probes/fa3_attention_probe.py): the production-shape inputs with exact attention over them, SDPA in bf16 on
the same values, the engine's warp-specialised kernel on them, and the timing of several kernels in turns."""
import statistics

import torch

from lab.bench import attention_inputs, event_ms, graph_call_ms, timings_in_turns
from engine.kernels.fp8_attention import attention_reference, qk_scale
from engine.kernels.fp8_attention_ws import SERVED_OPTIONS, WarpSpecializedFP8Attention

H, M, S, D, LIVE = 20, 757, 5824, 128, 5785
SHAPE = {"heads": H, "queries": M, "slots": S, "live": LIVE, "head_dim": D}


def probe_inputs(dev: torch.device) -> tuple:
    """e4m3 q (H, M, D), K and V (H, S, D), Vᵀ (H, D, S), the validity bytes (the live slots a prefix), the
    per-head scale (equal for every head) and the relative L2 error of an (M, H*D) output against exact
    attention over the same e4m3 values."""
    _, (q8, k8, vt8), sc = attention_inputs(H, M, S, D, dev, seed=0)
    v8 = vt8.transpose(1, 2).contiguous()
    valid = torch.zeros(S, dtype=torch.int8, device=dev)
    valid[:LIVE] = 1
    ref = attention_reference(q8, k8, vt8, valid, sc, sc, sc)  # (M, H*D) float32
    return q8, k8, v8, vt8, valid, sc, lambda got: ((got.float() - ref).norm() / ref.norm()).item()


def sdpa_bf16_run(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, sc: torch.Tensor) -> tuple:
    """(call, output) of torch's SDPA in bf16 on the same values, dequantised, K and V cut to the live slots."""
    qb, kb, vb = (x.float().mul(sc.view(H, 1, 1)).bfloat16()[None] for x in (q8, k8[:, :LIVE], v8[:, :LIVE]))
    call = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
    return call, lambda: call()[0].transpose(0, 1).reshape(M, H * D)


def ws_fp8_run(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, valid: torch.Tensor, sc: torch.Tensor,
               **options) -> tuple:
    """(call, output) of the engine's warp-specialised FP8 kernel on the same values (`options`: its tile options;
    none: as the ring cache serves it)."""
    ws = WarpSpecializedFP8Attention(H, M, S, D, q8.device, **(options or SERVED_OPTIONS))
    ws.mark_live_tiles(valid)
    vt_ws, out = ws.arrange_v(vt8), torch.empty(M, H * D, device=q8.device, dtype=torch.bfloat16)
    qks = qk_scale(sc, sc, D)
    return lambda: ws(q8, k8, vt_ws, valid, qks, sc, out), lambda: out


def time_in_turns(runs: dict, dev: torch.device, repeats: int, rel_err) -> dict:
    """{name: (call, output)} -> {name: {us (median), us_runs, rel_err, timing, speedup_vs_sdpa_bf16}}. Each is timed
    as a CUDA graph of 20 calls (the GPU's time, not the host's launch cost); one that cannot be captured is timed
    launched from Python instead, and says so. The runs go in turns, so clocks and temperature drift alike for all."""
    timing = {}
    for name, (fn, _) in runs.items():
        try:
            graph_call_ms(fn, dev, 1)
            timing[name] = "CUDA graph of 20 calls"
        except Exception as e:
            timing[name] = f"launched from Python, 20 calls between events (capture failed: {type(e).__name__})"
            torch.cuda.synchronize()

    def time_one(run: tuple) -> float:  # (call, whether it runs as a graph) -> us
        fn, graphed = run
        return 1000 * (graph_call_ms(fn, dev, 3) if graphed else event_ms(fn, dev, 20))

    graphed = {name: (fn, timing[name].startswith("CUDA")) for name, (fn, _) in runs.items()}
    times = timings_in_turns(graphed, time_one, repeats)
    result = {}
    for name, (fn, output) in runs.items():
        fn()
        result[name] = {"us": statistics.median(times[name]), "us_runs": times[name], "rel_err": rel_err(output()),
                        "timing": timing[name]}
    for name in runs:
        result[name]["speedup_vs_sdpa_bf16"] = result["sdpa_bf16"]["us"] / result[name]["us"]
    return result
