"""Where one rank's serving step spends its GPU time, kernel by kernel (torch.profiler).

    python tools/step_profile.py [--tp-shard 3] [--attention-options JSON]   # on a GPU; prints JSON
    (tile options name their kernel: '{"kernel": "ws", "stages": 2}' or '{"kernel": "triton", "block_n": 64}')

The step runs eagerly here (no CUDA graph) so that every kernel shows by name; kernel durations
are the GPU's own, launch gaps are not counted. Kernels are grouped by name and sorted by total time.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench import random_shard
from engine.config import get_spec
from engine.session import EngineSession


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="characters-57b")
    ap.add_argument("--tp-shard", type=int, default=3)
    ap.add_argument("--attention-options", type=json.loads, default=None)
    ap.add_argument("--fast-accum", choices=("on", "off"), default="on", help="as in engine.bench step")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = get_spec(args.spec)
    fast_accum = args.fast_accum == "on"
    model = random_shard(spec, args.tp_shard, dev, torch.bfloat16, fp8_gemms=True, fast_accum=fast_accum)
    session = EngineSession(model, cache="ring", kv_dtype="fp8", backend="triton", attention_options=args.attention_options)
    with torch.no_grad():
        session.start(torch.randn(spec.latent_channels, *spec.latent_grid, device=dev, dtype=torch.bfloat16))
        audio = torch.randn(spec.frames_per_latent, spec.n_mels, device=dev)
        for _ in range(3):
            session.push_audio_features(audio)
            session.step()
        torch.cuda.synchronize()
        session.push_audio_features(audio)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            session.step()
            torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[e.name] += 1
    rows = sorted(total, key=total.get, reverse=True)
    print(json.dumps({"spec": spec.name, "tp_shard": args.tp_shard, "device": torch.cuda.get_device_name(), "fast_accum": fast_accum,
                      "kernel_ms_total": sum(total.values()) / 1000,
                      "kernels": [{"name": n[:90], "ms": total[n] / 1000, "calls": count[n],
                                   "us_per_call": total[n] / count[n]} for n in rows[:40]]}, indent=1))


if __name__ == "__main__":
    main()
