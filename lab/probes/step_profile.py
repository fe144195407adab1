"""Where one rank's serving step spends its GPU time, kernel by kernel (torch.profiler).

    python -m lab.probes.step_profile [--tp-shard 3] [--attention-options JSON]   # on a GPU; prints JSON
    (tile options name their kernel: '{"kernel": "ws", "stages": 2}' or '{"kernel": "triton", "block_n": 64}')
    python -m lab.probes.step_profile --graph    # the served step: its CUDA graph replayed, on the GPU's timeline

By default the step runs eagerly (no CUDA graph); kernel durations are the GPU's own, launch gaps
are not counted. Kernels are grouped by name and sorted by total time. With --graph, steps are
replayed as served and each one's kernels are laid on the timeline: its span (first kernel's start
to last kernel's end), the time at least one kernel runs (busy), the idle gaps between kernels, and
the kernel time summed, which exceeds busy by what the two streams (a block's MLP branch beside its
attention) ran at once. A kernel's duration there includes its wait for SMs the other stream holds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import get_spec
from engine.options import new_session
from engine.session import EngineSession
from lab.bench import SERVED, attention_options_arg, random_shard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="characters-57b")
    ap.add_argument("--tp-shard", type=int, default=3)
    ap.add_argument("--attention-options", type=attention_options_arg, default=None, help="as in lab.bench step")
    ap.add_argument("--fast-accum", choices=("on", "off"), default="on", help="as in lab.bench step")
    ap.add_argument("--graph", action="store_true", help="profile the served step (CUDA graph) on the GPU's timeline")
    ap.add_argument("--steps", type=int, default=3, help="steps profiled with --graph")
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = get_spec(args.spec)
    fast_accum = args.fast_accum == "on"
    model = random_shard(spec, args.tp_shard, dev, torch.bfloat16, fp8_gemms=True, fast_accum=fast_accum)
    # the served session, as lab.bench step builds it: eager unless --graph
    session = new_session(model, replace(SERVED, cuda_graph=args.graph), attention=args.attention_options)
    if args.graph:
        print(json.dumps({"spec": spec.name, "tp_shard": args.tp_shard, "device": torch.cuda.get_device_name(),
                          "fast_accum": fast_accum, **graph_timeline(session, spec, dev, args.steps)}, indent=1))
        return
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


def idle_gaps(kernels: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """(gap us, the kernel that ended last before it, the kernel after it) for every stretch with no kernel running;
    kernels as (start us, duration us, name), sorted by start."""
    gaps = []
    end, last = kernels[0][0] + kernels[0][1], kernels[0][2]
    for start, dur, name in kernels[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if start + dur > end:
            end, last = start + dur, name
    return gaps


def timeline(kernels: list[tuple[float, float, str]]) -> dict:
    """One step's kernels as (start us, duration us, name), sorted by start: span, busy, gaps, kernel time."""
    gaps = [g for g, _, _ in idle_gaps(kernels)]
    span = max(s + d for s, d, _ in kernels) - kernels[0][0]
    return {"kernels": len(kernels), "span_ms": span / 1e3, "busy_ms": (span - sum(gaps)) / 1e3,
            "idle_gaps": len(gaps), "idle_ms": sum(gaps) / 1e3, "idle_gap_median_us": statistics.median(gaps) if gaps else 0.0,
            "idle_gap_max_us": max(gaps, default=0.0), "kernel_ms": sum(d for _, d, _ in kernels) / 1e3}


@torch.no_grad()
def graph_timeline(session: EngineSession, spec, dev: torch.device, steps: int) -> dict:
    """Served steps (CUDA graph replays), each on the GPU timeline: each step runs alone, after an idle pause (which
    tells steps apart on the timeline; the profiler's own cost is in the figures too)."""
    session.start(torch.randn(spec.latent_channels, *spec.latent_grid, device=dev, dtype=torch.bfloat16))
    audio = torch.randn(spec.frames_per_latent, spec.n_mels, device=dev)
    for _ in range(4):  # the first captures the graph
        session.push_audio_features(audio)
        session.step()
    torch.cuda.synchronize()
    pause_us = 20_000
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):  # each step() alone between pauses, timed as lab.bench times it (sync to sync)
            session.push_audio_features(audio)
            torch.cuda.synchronize()
            time.sleep(pause_us / 1e6)
            t0 = time.perf_counter()
            session.step()
            torch.cuda.synchronize()
            walls.append(1e3 * (time.perf_counter() - t0))
            time.sleep(pause_us / 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["dur"], e["name"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    per_step, current, end = [], [], kernels[0][0]
    for k in kernels:
        if k[0] - end > pause_us / 2:
            per_step.append(current)
            current = []
        current.append(k)
        end = max(end, k[0] + k[1])
    per_step.append(current)
    per_step = [ks for ks in per_step if len(ks) > max(map(len, per_step)) // 2]  # the steps, not the audio pushes between
    if len(per_step) != steps:  # an idle gap inside a step as long as the pause would split it
        raise RuntimeError(f"told {len(per_step)} steps apart on the timeline, ran {steps}")
    rows = [{"wall_ms": wall, **timeline(ks)} for wall, ks in zip(walls, per_step)]
    by_name: dict[str, float] = defaultdict(float)
    for _, dur, name in per_step[-1]:
        by_name[name[:90]] += dur / 1e3
    widest = sorted(idle_gaps(per_step[-1]), reverse=True)[:6]  # the last step's, with the kernels either side
    return {"mode": "CUDA graph replay, timeline", "pause_ms": pause_us / 1e3, "steps": rows,
            "first_kernels_last_step": [{"at_us": round(t - per_step[-1][0][0], 1), "us": round(d, 1), "name": n[:60]}
                                        for t, d, n in per_step[-1][:14]],
            "widest_gaps_last_step": [{"us": round(g, 1), "after": a[:60], "before": b[:60]} for g, a, b in widest],
            **{f"median_{k}": statistics.median(r[k] for r in rows) for k in ("wall_ms", "span_ms", "busy_ms", "idle_ms", "kernel_ms")},
            "kernels_last_step": [{"name": n, "ms": round(t, 3)} for n, t in sorted(by_name.items(), key=lambda x: -x[1])[:12]]}


if __name__ == "__main__":
    main()
