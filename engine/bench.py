"""Benchmarks; each prints one JSON object (medians, baseline measured in the same run).

    python -m engine.bench cache --device cpu --json
    python -m engine.bench cache --device cuda --spec characters-57b --tp-shard 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

from engine import fp8
from engine.cache import ReferenceKVCache, RingKVCache
from engine.config import SPECS, ModelSpec, get_spec, shard_spec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(1000 * (time.perf_counter() - t0))
    return out


def _random_frame(spec: ModelSpec, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(spec.n_heads, n, spec.head_dim, generator=g, device=device, dtype=torch.float32)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(dtype)  # RMS-normalised heads, as the model makes them


def bench_cache(spec: ModelSpec, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Per-step cache upkeep: the naive way (concatenate, rotate and quantise the whole window
    at every attention call) vs the ring (rotate + quantise the new frame once at write time,
    re-derive the sink once a step, one delta rotation every `reset_every` steps)."""
    g = torch.Generator(device=device).manual_seed(0)
    L, F = spec.n_blocks, spec.frame_tokens
    gains = [torch.ones(spec.n_heads, spec.head_dim, device=device)] * L
    calls = spec.passes * L

    naive = ReferenceKVCache(spec, dtype=dtype, device=device)
    for layer in range(L):
        naive.sink[layer] = (_random_frame(spec, spec.reference_tokens, dtype, device, g),) * 2
    for _ in range(spec.window_frames - 1):
        naive.history.append([(_random_frame(spec, F, dtype, device, g),) * 2 for _ in range(L)])
    naive.step = spec.window_frames  # a full window
    k_new = _random_frame(spec, F, dtype, device, g)
    scales = fp8.per_head_scale(gains[0])

    def naive_step() -> None:
        for _ in range(spec.passes):
            for layer in range(L):
                k, v = naive.gather(layer, k_new, k_new)
                fp8.quantize(k, scales), fp8.quantize(v, scales)

    ring = RingKVCache(spec, gains, gains, kv_dtype="fp8", dtype=dtype, device=device)
    ring.sink_k.copy_(torch.randn(ring.sink_k.shape, generator=g, device=device))
    for t in range(spec.window_frames):
        ring.begin_step(t)
    ring.reset_every = 0  # steady-state steps; the reset is timed on its own below

    def ring_step() -> None:
        ring.step -= 1
        ring.begin_step(ring.step + 1)  # the once-a-step sink re-derivation
        for _ in range(spec.passes):
            for layer in range(L):
                ring.write(layer, k_new, k_new)

    naive_ms = time_ms(naive_step, device, repeats)
    ring_ms = time_ms(ring_step, device, repeats)
    reset_ms = time_ms(ring.rotate_window, device, repeats)
    n_ms, r_ms, z_ms = (statistics.median(x) for x in (naive_ms, ring_ms, reset_ms))
    per_step_reset = z_ms / spec.reset_every
    return {
        "bench": "cache",
        "spec": spec.name,
        "shape": {"layers": L, "heads": spec.n_heads, "head_dim": spec.head_dim, "cache_slots": spec.cache_slots,
                  "new_tokens": F, "passes": spec.passes, "attention_calls_per_step": calls},
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "naive_ms": n_ms,
        "ring_ms": r_ms,
        "speedup": n_ms / r_ms,
        "reset_ms": z_ms,
        "ring_ms_with_reset_amortised": r_ms + per_step_reset,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench", description="talkloop engine benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    c = sub.add_parser("cache", help="per-step KV cache upkeep: naive vs ring")
    for q in (c,):
        q.add_argument("--spec", default="demo", choices=sorted(SPECS))
        q.add_argument("--tp-shard", type=int, default=1, help="benchmark one rank's share at this tensor-parallel degree")
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--repeats", type=int, default=10)
        q.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = p.parse_args(argv)
    try:
        spec = shard_spec(get_spec(args.spec), args.tp_shard)
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but no CUDA GPU is visible")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        result = bench_cache(spec, device, dtype, args.repeats)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["tp_shard"] = args.tp_shard
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
