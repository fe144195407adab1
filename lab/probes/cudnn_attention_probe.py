"""NVIDIA's own FP8 attention on this GPU at the production shape: cuDNN's FP8 SDPA (through the
`nvidia-cudnn-frontend` package, not a dependency of the engine) beside SDPA in bf16 and the warp-specialised
kernel, on the same e4m3 q, K, V, timed in one process in turns, each as a CUDA graph of 20 calls. Configurations cuDNN refuses are listed
with its reason.

    pip install nvidia-cudnn-frontend   # it loads the cuDNN that PyTorch ships
    python -m lab.probes.cudnn_attention_probe   # on a GPU; prints one JSON object

The heads share one scale here (cuDNN takes one descale per tensor; the engine keeps one per head), and the
live slots are a prefix (cuDNN masks by sequence length, not per slot).
"""
import json
import math
from importlib.metadata import version

import torch

from lab.probes.attention_probe_common import D, H, LIVE, M, S, SHAPE, probe_inputs, sdpa_bf16_run, time_in_turns, ws_fp8_run
from engine.kernels.fp8_attention_ws import SERVED_OPTIONS

dev = torch.device("cuda")
O_SCALE = 32.0  # cuDNN writes O in e4m3 on Hopper: |o| <= max |v| ~ 4 here, so 32 keeps it well inside 448
REPEATS = 5


def main() -> dict:
    import cudnn

    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__, "cudnn": cudnn.backend_version(), "cudnn_frontend": version("nvidia-cudnn-frontend"),
              "device": torch.cuda.get_device_name(), "shape": SHAPE}
    q8, k8, v8, vt8, valid, sc, rel_err = probe_inputs(dev)

    runs = {"sdpa_bf16": sdpa_bf16_run(q8, k8, v8, sc)}
    runs["ws_fp8"] = ws_fp8_run(q8, k8, vt8, valid, sc)  # the served configuration
    result["ws_fp8_options"] = dict(SERVED_OPTIONS)

    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    refused = {}
    for name, out_type, v_transposed, padded in (("cudnn_fp8_prefix", "fp8", False, False),
                                                  ("cudnn_fp8_padding_mask", "fp8", False, True),
                                                  ("cudnn_bf16_out", "bf16", False, False),
                                                  ("cudnn_fp8_v_transposed", "fp8", True, False)):
        try:
            runs[name] = _cudnn_run(cudnn, handle, q8, k8, vt8 if v_transposed else v8, sc[0].item(), out_type, v_transposed, padded)
        except Exception as e:  # cuDNN declines the configuration on this GPU
            refused[name] = f"{type(e).__name__}: {str(e)[:300]}"
    result.update(time_in_turns(runs, dev, REPEATS, rel_err))
    result["refused"] = refused
    return result


def _cudnn_run(cudnn, handle, q8, k8, v8, scale: float, out_type: str, v_transposed: bool, padded: bool):
    f8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    skv = S if padded else LIVE
    q = graph.tensor(name="q", dim=[1, H, M, D], stride=[H * M * D, M * D, D, 1], data_type=f8)
    k = graph.tensor(name="k", dim=[1, H, skv, D], stride=[H * S * D, S * D, D, 1], data_type=f8)
    v_stride = [H * S * D, S * D, 1, S] if v_transposed else [H * S * D, S * D, D, 1]
    v = graph.tensor(name="v", dim=[1, H, skv, D], stride=v_stride, data_type=f8)
    scalar = lambda n, dtype=f32: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)
    scales = {n: scalar(n) for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    masks = {}
    if padded:
        masks = {"seq_len_q": scalar("seq_len_q", cudnn.data_type.INT32), "seq_len_kv": scalar("seq_len_kv", cudnn.data_type.INT32)}
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, **scales, is_inference=True, attn_scale=1.0 / math.sqrt(D),
                                          use_causal_mask=False, use_padding_mask=padded, **masks)
    o.set_output(True).set_dim([1, H, M, D]).set_stride([H * M * D, M * D, D, 1])
    o.set_data_type(f8 if out_type == "fp8" else cudnn.data_type.BFLOAT16)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    full = lambda x: torch.full((1, 1, 1, 1), x, device=dev, dtype=torch.float32)
    o_t = torch.empty(1, H, M, D, device=dev, dtype=torch.float8_e4m3fn if out_type == "fp8" else torch.bfloat16)
    o_scale = O_SCALE if out_type == "fp8" else 1.0
    pack = {q: q8, k: k8, v: v8, o: o_t, amax_s: full(0.0), amax_o: full(0.0), scales["descale_q"]: full(scale),
            scales["descale_k"]: full(scale), scales["descale_v"]: full(scale), scales["descale_s"]: full(1 / 448.0),
            scales["scale_s"]: full(448.0), scales["scale_o"]: full(o_scale)}
    if padded:
        pack[masks["seq_len_q"]] = torch.full((1, 1, 1, 1), M, device=dev, dtype=torch.int32)
        pack[masks["seq_len_kv"]] = torch.full((1, 1, 1, 1), LIVE, device=dev, dtype=torch.int32)
    workspace = torch.empty(graph.get_workspace_size(), device=dev, dtype=torch.uint8)
    def fn():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)  # a graph captures on its own stream
        graph.execute(pack, workspace, handle=handle)
    return fn, lambda: (o_t.float() / o_scale)[0].transpose(0, 1).reshape(M, H * D)


if __name__ == "__main__":
    print(json.dumps(main()))
