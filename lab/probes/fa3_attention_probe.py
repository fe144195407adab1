"""FlashAttention-3's FP8 forward on this GPU at the production shape, beside SDPA in bf16 and the
warp-specialised kernel: the same e4m3 q, K, V and per-head scales (FA3 takes one descale per batch and
head, as the engine keeps them), timed in one process in turns, each as a CUDA graph of 20 calls.

FA3 has no wheel on PyPI; build it from a flash-attention checkout first (lab/device/build_fa3.sh), then

    PYTHONPATH=flash-attention/hopper python -m lab.probes.fa3_attention_probe   # on a Hopper GPU; prints one JSON object

FA3 masks by sequence length, not per slot: its K and V are the live slots, a prefix here. The last run calls it
as the engine would have to: K and V views of every slot, the live count in `cache_seqlens` (FA3's variable-length
build), so the shapes stay fixed while the window fills. FA3_SOURCE, when set, names the source it was built from
in the result; `calls_per_step` is how many attention calls the 57b step makes (blocks x passes). `energy`: ours and
FA3's engine-style call, each replayed back to back for seconds (lab.bench.sustained_energy), as the served
step runs them at the GPU's power limit.
"""
import json
import os

import torch
import triton

from lab.probes.attention_probe_common import D, H, LIVE, M, SHAPE, probe_inputs, sdpa_bf16_run, time_in_turns, ws_fp8_run
from lab.bench import sustained_energy
from engine.config import get_spec
from lab.gpu_energy import EnergyMeter
from engine.kernels.fp8_attention_ws import SERVED_OPTIONS

dev = torch.device("cuda")
REPEATS = 5


def main() -> dict:
    from flash_attn_interface import flash_attn_func, flash_attn_with_kvcache  # FA3's own package (flash_attn_3._C underneath)

    spec = get_spec("characters-57b")
    result = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
              "fa3_source": os.environ.get("FA3_SOURCE"), "shape": SHAPE, "calls_per_step": spec.n_blocks * spec.passes}
    q8, k8, v8, vt8, valid, sc, rel_err = probe_inputs(dev)

    runs = {"sdpa_bf16": sdpa_bf16_run(q8, k8, v8, sc)}
    runs["ws_fp8"] = ws_fp8_run(q8, k8, vt8, valid, sc)  # the served configuration
    result["ws_fp8_options"] = dict(SERVED_OPTIONS)

    descale = sc.view(1, H).float().contiguous()  # (batch, heads)
    bshd = lambda x: x.transpose(0, 1).unsqueeze(0)  # (H, n, D) -> (1, n, H, D), a view
    q_all, k_all, v_all = bshd(q8), bshd(k8), bshd(v8)  # strided, straight from the (H, S, D) buffers
    views = [q_all, k_all[:, :LIVE], v_all[:, :LIVE]]
    copies = [x.contiguous() for x in views]
    for name, (q, k, v), splits in (("fa3_fp8", copies, 1), ("fa3_fp8_cache_views", views, 1),
                                    ("fa3_fp8_splits_auto", copies, 0)):  # 0: FA3's own choice of KV splits
        call = lambda q=q, k=k, v=v, n=splits: flash_attn_func(q, k, v, q_descale=descale, k_descale=descale,
                                                                 v_descale=descale, num_splits=n)
        runs[name] = (call, lambda call=call: call()[0].reshape(M, H * D))  # (1, M, H, D) bf16
    live = torch.full((1,), LIVE, dtype=torch.int32, device=dev)
    cached = lambda: flash_attn_with_kvcache(q_all, k_all, v_all, cache_seqlens=live, q_descale=descale,
                                             k_descale=descale, v_descale=descale, num_splits=1)
    runs["fa3_fp8_kvcache"] = (cached, lambda: cached()[0].reshape(M, H * D))
    with torch.no_grad():
        result.update(time_in_turns(runs, dev, REPEATS, rel_err))
        meter = EnergyMeter.open(dev)
        if meter is not None:
            with meter:
                result["energy"] = {name: sustained_energy(runs[name][0], dev, meter) for name in ("ws_fp8", "fa3_fp8_kvcache")}
                result["energy"]["power_limit_w"] = meter.power_limit_w()
    try:
        from flash_attn_config import CONFIG  # written by FA3's setup.py: what the build left out

        result["fa3_build_flags"] = {k: v for k, v in CONFIG["build_flags"].items() if v}
    except ImportError:
        pass
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
