"""Benchmarks; each prints one JSON object (medians, baseline measured in the same run).

    python -m lab.bench cache --device cpu --json
    python -m lab.bench cache --device cuda --spec characters-57b --tp-shard 3 --json
    python -m lab.bench step --spec characters-57b --tp-shard 3 --json
    python -m lab.bench attention --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Callable, TypeVar

import torch

from engine import fp8
from engine.build import start_processes
from engine.cache import ReferenceKVCache, RingKVCache, attention
from engine.config import SPECS, ModelSpec, get_spec, shard_spec
from engine.model import CausalVideoDiT
from engine.options import EngineOptions, new_session
from engine.parallel import apply_tensor_parallel
from engine.session import EngineSession
from engine.weights import pick_device
from lab.gpu_energy import EnergyMeter, EnergyWindow

T = TypeVar("T")
# The sessions the step benchmarks time: the serving path (ring FP8 cache, Triton FP8 attention, CUDA graph) and the
# baseline (the plain path: float cache with read-time RoPE, SDPA)
SERVED = EngineOptions(name="served", cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
BASELINE = EngineOptions(name="baseline", cache="reference")


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


def event_ms(fn: Callable[[], None], device: torch.device, repeats: int, inner: int = 20) -> float:
    """Median per-call time of `inner` back-to-back calls between CUDA events (short kernels, clocks up)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _random_frame(spec: ModelSpec, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(spec.n_heads, n, spec.head_dim, generator=g, device=device, dtype=torch.float32)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(dtype)  # RMS-normalised heads, as the model makes them


def bench_cache(spec: ModelSpec, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Per-step cache upkeep: the naive way (concatenate, rotate and quantise the whole window
    at every attention call) vs the ring (rotate + quantise the new frame once at write time,
    re-derive the sink once a step, one delta rotation every `reset_every` steps), the ring in
    PyTorch and, on a GPU, in its Triton kernels."""
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
    triton = {}
    from engine import kernels

    if device.type == "cuda" and kernels.available():
        fast = RingKVCache(spec, gains, gains, q_gains=gains, kv_dtype="fp8", dtype=dtype, device=device, backend="triton")
        fast.begin_step(0)
        triton = {"ring_triton_ms": _graph_ms(_triton_upkeep(fast, spec, k_new), device, repeats),
                  "reset_triton_ms": statistics.median(time_ms(lambda: fast.rotate_window(count=False), device, repeats))}
        triton["speedup_triton"] = statistics.median(naive_ms) / triton["ring_triton_ms"]
    n_ms, r_ms, z_ms = (statistics.median(x) for x in (naive_ms, ring_ms, reset_ms))
    per_step_reset = z_ms / spec.reset_every
    return {
        "bench": "cache",
        "date": time.strftime("%Y-%m-%d"),
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
        **triton,
        "torch": torch.__version__,
    }


def _device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)


@contextlib.contextmanager
def _environment(name: str, value: str):
    """The environment variable `name` set to `value` inside the block, and back as it was after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _optional(context: contextlib.AbstractContextManager | None) -> contextlib.AbstractContextManager:
    """`context`, or one that does nothing where there is none (no NVML meter on this machine)."""
    return context if context is not None else contextlib.nullcontext()


def _graph_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median time of `fn` replayed as a CUDA graph (no launch gaps), or eagerly on the CPU."""
    if device.type != "cuda":
        return statistics.median(time_ms(fn, device, repeats))
    graph = _captured(fn, device)
    ms = statistics.median(time_ms(graph.replay, device, repeats))
    del graph
    return ms


def _captured(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after one warm-up call on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def sustained_energy(fn: Callable[[], None], device: torch.device, meter: EnergyMeter | None, seconds: float = 3.0,
                     calls: int = 20) -> dict:
    """Per call of `fn`, replayed in CUDA graphs of `calls` calls back to back for `seconds` after as long again to
    warm up (long enough for the GPU to settle at its power limit where the work takes it there): joules, mean
    watts, median SM clock and time. Empty without a meter."""
    if meter is None:
        return {}

    def run() -> None:
        for _ in range(calls):
            fn()
    graph = _captured(run, device)

    def replay_for(graph: torch.cuda.CUDAGraph, s: float, window: EnergyWindow | None = None) -> int:
        """How many times `graph` replays in `s` seconds (measured by `window`, where given)."""
        replays, end = 0, time.perf_counter() + s
        with _optional(window):
            while time.perf_counter() < end:
                graph.replay()
                replays += 1
                if replays % 4 == 0:  # never more than a few replays queued: the window ends with the work
                    _sync(device)
            _sync(device)
        return replays

    replay_for(graph, seconds)
    window = EnergyWindow(meter)
    n = calls * replay_for(graph, seconds, window)
    r = window.result(n)
    del graph
    return {"joules_per_call": r["joules_per_step"], "watts": r["watts"], "sm_clock_mhz": r.get("sm_clock_mhz"),
            "us_per_call": 1e6 * r["seconds"] / n}


def rms_heads(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Gaussian vectors at unit RMS along the last axis, on g's device: head-normed q, k or v for attention benchmarks."""
    x = torch.randn(*shape, generator=g, device=g.device)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def graph_call_ms(fn: Callable[[], None], device: torch.device, repeats: int, calls: int = 20) -> float:
    """Median per-call time of `calls` back-to-back calls captured in one CUDA graph: the GPU's time, without
    the host's launch cost (the serving step replays its kernels so). Eager on the CPU."""
    def run() -> None:
        for _ in range(calls):
            fn()
    return _graph_ms(run, device, repeats) / calls


@torch.no_grad()
def random_shard(spec: ModelSpec, tp: int, device: torch.device, dtype: torch.dtype, *, fp8_gemms: bool,
                 fused: bool = True, seed: int = 0, branch_streams: bool = True, fast_accum: bool = True,
                 gemm_kernels: dict[str, str] | None = None) -> CausalVideoDiT:
    """Rank 0's share of a random-weight model at tensor-parallel degree tp, built in place on the device
    (`gemm_kernels`: FP8 linears' kernels over the engine's defaults, as apply_fp8_kernels takes them)."""
    from engine.fused_block import apply_fp8_kernels

    with torch.device("meta"):
        model = CausalVideoDiT(spec).to(dtype)  # materialise in the target dtype: the full 57b is 97 GB in bf16
    apply_tensor_parallel(model, 0, tp)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.rand(p.shape, generator=g, device=device))
        elif p.ndim == 2 and not name.endswith("modulation"):
            p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    model = model.to(dtype)
    if fp8_gemms:
        apply_fp8_kernels(model, fuse=fused, branch_streams=branch_streams, fast_accum=fast_accum, gemm_kernels=gemm_kernels)
    return model.eval()


def _gemms_of_a_step(model: CausalVideoDiT, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """Every block linear of one step (passes x blocks), on activations of the step's shape, fed as the
    step feeds them (FP8 linears take pre-quantised inputs where the fused block quantises for them, and the
    out-projection the attention's e4m3 output: no quantisation pass is timed as part of a GEMM)."""
    from engine.fused_block import FusedBlock
    from engine.kernels.fp8_linear import FP8Linear, quantize_rows_reference

    F = spec.frame_tokens
    b0 = model.blocks[0]
    h = torch.randn(F, spec.dim, device=device, dtype=dtype)
    a = torch.randn(F, b0.attn_out.in_features, device=device, dtype=dtype)
    m = torch.randn(F, b0.mlp_out.in_features, device=device, dtype=dtype)
    if isinstance(b0.qkv, FP8Linear) and isinstance(b0, FusedBlock):
        h8, a8, m8 = quantize_rows_reference(h), quantize_rows_reference(a), quantize_rows_reference(m)

        def run() -> None:
            for _ in range(spec.passes):
                for blk in model.blocks:
                    blk.qkv.forward_quantized(*h8), blk.attn_out.forward_quantized(*a8), blk.mlp_in.swiglu_product(*h8)
                    blk.mlp_out.forward_quantized(*m8)
    else:
        def run() -> None:
            for _ in range(spec.passes):
                for blk in model.blocks:
                    blk.qkv(h), blk.attn_out(a), blk.mlp_in(h), blk.mlp_out(m)

    return run


UPKEEP_ROUNDS = 3  # the cache upkeep and its variants, timed in turns
FLIP_ROUNDS = 3  # the step with one setting flipped and the served step, timed in turns
ATTENTION_ROUNDS = 5  # SDPA and the fastest FP8 configuration (both outputs), timed in turns for the ratio
# Each of those timings starts from an idle GPU: a timing of ~20 ms otherwise inherits the clock that the one before
# left (on an H200, the FP8 kernel timed right after SDPA ran 1-2% slower than when timed first)
ATTENTION_PAUSE_S = 0.1


def timings_in_turns(subjects: dict[str, T], time_one: Callable[[T], float], rounds: int) -> dict[str, list[float]]:
    """Each subject's `rounds` timings, taken in turns. The GPU's clock drifts between timings (it climbs back
    after a part that held the GPU at its power limit), and variants timed one after another would each carry
    the drift of their place in the order."""
    runs: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(rounds):
        for name, subject in subjects.items():
            runs[name].append(time_one(subject))
    return runs


def _in_turns(subjects: dict[str, T], time_one: Callable[[T], float], rounds: int) -> dict[str, float]:
    """Each subject's median over `rounds` timings taken in turns (`timings_in_turns`)."""
    return {name: statistics.median(times) for name, times in timings_in_turns(subjects, time_one, rounds).items()}


def _triton_upkeep(cache: RingKVCache, spec: ModelSpec, q: torch.Tensor, head_norm=None,
                   **write_options) -> Callable[[], None]:
    """One step of the triton ring's upkeep: the sink re-derived once, then a frame write per attention call
    (with `head_norm`, applying the q, k, v head norms as the serving block has it do; `write_options`,
    the write's settings, e.g. block_t and num_warps; V's slots in the order the cache's attention kernel
    reads them unless pv_order is given)."""
    from engine.kernels.rope_write import rope_store, write_frame

    L, H, S, D = cache.k.shape
    write_options = {"pv_order": cache.v_positions is not None, **write_options}

    def upkeep() -> None:
        rope_store(cache.sink_k.view(L * H, -1, D), cache._ref_cos, cache._ref_sin, cache.pos_idx,
                   cache.k.view(L * H, S, D), cache.k_scale.view(-1))
        for _ in range(spec.passes):
            for layer in range(L):
                write_frame(q, q, q, cache._frame_cos, cache._frame_sin, cache.pos_idx, cache.slot, cache.q8,
                            cache.k[layer], cache.vt[layer], cache.valid, cache.q_scale[layer],
                            cache.k_scale[layer], cache.v_scale[layer], head_norm=head_norm, **write_options)

    return upkeep


def _session_steps(session, steps: int, device: torch.device, graph_times: list[dict] | None = None) -> list[float]:
    """Wall times (ms) of `steps` steps, each from a synchronised start to its end; each step's graph timing
    (`EngineSession.last_graph_times`) appended to `graph_times` where the session replays one."""
    out = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        session.step()
        _sync(device)
        out.append(1000 * (time.perf_counter() - t0))
        if graph_times is not None and (marks := session.last_graph_times()) is not None:
            graph_times.append(marks)
    return out


def _graph_stats(graph_times: list[dict], suffix: str = "") -> dict:
    """Medians of the steps' graph timings: the graph's own GPU time and its start's lag behind its inputs' copy."""
    if not graph_times:
        return {}
    return {f"step_graph_ms{suffix}": statistics.median(g["graph_ms"] for g in graph_times),
            f"graph_launch_lag_ms{suffix}": statistics.median(g["launch_lag_ms"] for g in graph_times)}


def _attend_without_fp8_out(cache: RingKVCache) -> None:
    """Has `cache` answer every attend as if asked without `fp8_out` (the output in bf16, which the fused block
    quantises per row before the out-projection), to time the step against the served one, whose attention
    writes its output in e4m3.

    An instance attribute shadows the method: the session hands the model `self.cache.attend`, looked up at
    each pass (EngineSession._denoise), so eager steps and the CUDA graph captured from them call this one.
    The wrapper refers to its cache: `del cache.attend` when done, or the pair waits for the cyclic collector."""
    attend = cache.attend  # the bound method

    def bf16_attend(*args: object, **kwargs: object) -> torch.Tensor:
        return attend(*args, **{**kwargs, "fp8_out": False})

    cache.attend = bf16_attend


def _warm_up(session, audio: torch.Tensor, steps: int) -> None:
    """`steps` untimed steps (a graph session captures its graph in the first)."""
    for _ in range(steps):
        session.push_audio_features(audio)
        session.step()


def _timed_steps(session, audio: torch.Tensor, steps: int, warmup: int, device: torch.device, *, resets: bool,
                 before_step: Callable[[], None] | None = None, reset_needed: bool = True,
                 energy: EnergyWindow | None = None, graph_times: list[dict] | None = None) -> tuple[list[float], list[float]]:
    """Step times (ms) after `warmup` steps, steps with a position reset apart; with `resets`, go on
    (within two reset periods) until one reset step was timed too, unless `reset_needed` is False.
    `energy`, if given, is entered around the timed steps (not the warm-up); `graph_times` collects the
    steady steps' graph timings (`_session_steps`)."""
    _warm_up(session, audio, warmup)
    times: list[float] = []
    reset_times: list[float] = []
    every = session.cache.reset_every if resets else 0
    with _optional(energy):
        for _ in range(2 * steps + 2 * max(every, 1)):  # bounded: with resets every step, no step is steady-state
            if len(times) >= steps and not (resets and reset_needed and not reset_times):
                break
            session.push_audio_features(audio)
            if before_step is not None:
                before_step()
            reset = bool(every) and session.steps_done % every == 0
            (reset_times if reset else times).extend(  # each step synchronises
                _session_steps(session, 1, device, None if reset else graph_times))
    if not times:
        raise ValueError(f"every timed step was a position reset (reset_every={every}): no steady-state step to time")
    return times, reset_times


def _energy_stats(window: EnergyWindow, steps: int, suffix: str = "", clock: bool = True) -> dict:
    """The window's joules per step and mean watts (and median SM clock) under the step benchmark's names."""
    r = window.result(steps)
    names = {"joules_per_step": "step_joules", "watts": "step_watts", **({"sm_clock_mhz": "sm_clock_mhz"} if clock else {})}
    return {names[k] + suffix: v for k, v in r.items() if k in names}


def _paced_step_stats(session, audio: torch.Tensor, steps: int, device: torch.device,
                      meter: EnergyMeter | None = None) -> dict:
    """Steps started one real-time period apart (spec.step_seconds: a step's frames at the video's frame rate),
    each timed as in _timed_steps, reset steps apart. Back to back the GPU never idles between steps; at the
    cadence a real-time session keeps, it does. A step that outlasts its period starts the next one late (the
    schedule moves on from there, counted in `realtime_cadence_missed`) rather than back to back."""
    period = session.spec.step_seconds
    next_start = time.perf_counter()
    missed = 0

    def wait_for_slot() -> None:
        nonlocal next_start, missed
        now = time.perf_counter()
        next_start += period
        if next_start < now:
            next_start = now
            missed += 1
        time.sleep(next_start - now)

    window, graph_times = EnergyWindow(meter), []
    times, resets = _timed_steps(session, audio, steps, 1, device, resets=True, before_step=wait_for_slot, reset_needed=False,
                                 energy=window, graph_times=graph_times)
    # the GPU idles between paced steps: energy per step and mean power count those pauses, the clock would not say much
    return {"step_ms_at_realtime_cadence": statistics.median(times), "steps_timed_at_realtime_cadence": len(times),
            "realtime_cadence_ms": 1000 * period,
            "realtime_cadence_missed": missed, **_graph_stats(graph_times, "_at_realtime_cadence"),
            **_energy_stats(window, len(times) + len(resets), "_at_realtime_cadence", clock=False)}


def _step_stats(times: list[float], resets: list[float]) -> dict:
    out = {"step_ms": statistics.median(times), "step_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))]}
    if resets:
        out["reset_step_ms"] = statistics.median(resets)
    return out


@torch.no_grad()
def bench_step(spec_name: str, tp: int, device: torch.device, steps: int, warmup: int, attention_options: dict | None,
               branch_streams: bool = True, fast_accum: bool = True, gemm_kernels: dict[str, str] | None = None) -> dict:
    """One rank's step at tensor-parallel degree tp, communication left out: the serving path
    (ring FP8 cache with write-time kernels, FP8 attention, FP8 GEMMs, CUDA graph; each block's MLP
    branch on a side stream with `branch_streams`; FP8 GEMMs with fast accumulation with `fast_accum`;
    `gemm_kernels` over the engine's default FP8 GEMM kernels) vs the baseline (naive cache with
    read-time RoPE, SDPA in bf16, bf16 GEMMs, eager). The serving path's step is also timed with each
    of those settings flipped, on the same weights. Where NVML is readable, each configuration's timed
    steps also give their energy (joules per step, mean watts, median SM clock) beside the power limit, and
    the serving path's breakdown parts (GEMMs, attention, cache upkeep) theirs, each held back to back alone."""
    full = get_spec(spec_name)
    rank_spec = shard_spec(full, tp)  # local heads for the cache; the residual width stays full
    dtype = torch.bfloat16
    ref_latent = torch.randn(full.latent_channels, *full.latent_grid, device=device, dtype=dtype)
    audio = torch.randn(full.frames_per_latent, full.n_mels, device=device)
    result: dict = {"bench": "step", "date": time.strftime("%Y-%m-%d"), "spec": full.name, "tp_shard": tp, "communication": "left out (one rank's compute only)",
                    "device": _device_name(device), "torch": torch.__version__, "steps_asked": steps,
                    "branch_streams": branch_streams, "fast_accum": fast_accum, "attention_options": attention_options or {}}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    # Back to back for seconds, a GPU meets its power limit and lowers its clock: the step's energy is timed with it
    meter = EnergyMeter.open(device)
    if meter is not None:
        result["power_limit_w"], result["max_sm_clock_mhz"] = meter.power_limit_w(), meter.max_sm_clock_mhz()

    def run_config(fast: bool) -> dict:
        torch.cuda.empty_cache()
        model = random_shard(full, tp, device, dtype, fp8_gemms=fast, branch_streams=branch_streams, fast_accum=fast_accum,
                             gemm_kernels=gemm_kernels)
        torch.cuda.reset_peak_memory_stats(device)
        serving = lambda options=attention_options: new_session(model, SERVED, attention=options)
        session = serving() if fast else new_session(model, BASELINE)
        session.start(ref_latent)
        window, graph_times = EnergyWindow(meter), []
        times, resets = _timed_steps(session, audio, steps, warmup, device, resets=fast, energy=window, graph_times=graph_times)
        # the serving path goes on past `steps` until a reset step was timed too: its count is its own
        out = {**_step_stats(times, resets), "steps_timed": len(times), **_graph_stats(graph_times),
               "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9, **_energy_stats(window, len(times) + len(resets))}
        if fast:  # the same session with its steps started at the real-time cadence
            out.update(_paced_step_stats(session, audio, steps, device, meter))

        def time_flipped(other: EngineSession, key: str) -> None:
            """`other`, a fresh session on the same weights with one setting flipped, started and warmed up (its graph
            captured with the setting), then timed in turns with the served session, each replaying its own graph, so
            that the clock's drift falls on both alike: `key` is its median step, `key`_serving the served one's."""
            other.start(ref_latent)
            _warm_up(other, audio, warmup)
            median = lambda s: statistics.median(_timed_steps(s, audio, steps, 0, device, resets=False)[0])
            out.update(_in_turns({key: other, f"{key}_serving": session}, median, rounds=FLIP_ROUNDS))

        if fast:  # the same weights with one setting flipped
            from engine.kernels.fp8_linear import BLOCK_LINEARS

            linears = [getattr(b, n) for b in model.blocks for n in BLOCK_LINEARS]
            for name, on, objects in (("branch_streams", branch_streams, model.blocks), ("fast_accum", fast_accum, linears)):
                for o in objects:
                    setattr(o, name, not on)
                time_flipped(serving(), f"step_ms_{'without' if on else 'with'}_{name}")
                for o in objects:
                    setattr(o, name, on)
            # MLP-in's FP8 product on the other kernel (cuBLAS, or Triton with SwiGLU in its epilogue); q/k/v and MLP-out
            # on the other kernel where they share one; the out-projection on the other kernel; then all four on Triton
            # unless served so
            kernels = {n: getattr(model.blocks[0], n).gemm_kernel for n in BLOCK_LINEARS}
            out["gemm_kernels"] = kernels
            out["triton_block_n"] = {n: getattr(model.blocks[0], n).block_n for n in BLOCK_LINEARS if n != "mlp_in"}
            swap = lambda kernel: "cublas" if kernel == "triton" else "triton"
            flips = [(f"mlp_in_gemm_{swap(kernels['mlp_in'])}", ("mlp_in",), swap(kernels["mlp_in"]))]
            if kernels["qkv"] == kernels["mlp_out"]:
                flips.append((f"qkv_mlp_out_gemms_{swap(kernels['qkv'])}", ("qkv", "mlp_out"), swap(kernels["qkv"])))
            flips.append((f"attn_out_gemm_{swap(kernels['attn_out'])}", ("attn_out",), swap(kernels["attn_out"])))
            if set(kernels.values()) != {"triton"}:
                flips.append(("triton_gemms", BLOCK_LINEARS, "triton"))
            for label, names, kernel in flips:
                chosen = [getattr(b, n) for b in model.blocks for n in names]
                before = [o.gemm_kernel for o in chosen]
                for o in chosen:
                    o.gemm_kernel = kernel
                time_flipped(serving(), f"step_ms_with_{label}")
                for o, kernel_before in zip(chosen, before):
                    o.gemm_kernel = kernel_before
            out["attention_kernel"] = session.cache.attention_kernel
            out["attention_kernel_options"] = session.cache.attention_options
            if session.cache.attention_kernel == "ws":  # and with the Triton FP8 attention kernel instead
                time_flipped(serving({"kernel": "triton"}), "step_ms_with_triton_attention")
                if session.cache.attention_options.get("exp2") == "e4m3_bits":  # and with P nearest 2^x
                    from engine.kernels.fp8_attention_ws import NEAREST_P_OPTIONS

                    time_flipped(serving({"kernel": "ws", **NEAREST_P_OPTIONS}), "step_ms_with_attention_p_nearest")
            bf16_out = serving()  # the attention's output in bf16, quantised per row before the out-projection
            _attend_without_fp8_out(bf16_out.cache)
            time_flipped(bf16_out, "step_ms_with_attention_out_bf16")
            del bf16_out.cache.attend  # the wrapper and its cache refer to each other: freed with the session
            del bf16_out
            from engine.kernels import PDL_ENV, launch_pdl

            out["pdl"] = launch_pdl(device)
            if out["pdl"]:  # and with every kernel launched after the one before has ended (its graph captured so)
                with _environment(PDL_ENV, "0"):
                    time_flipped(serving(), "step_ms_without_pdl")
            out["flip_rounds"] = FLIP_ROUNDS
        # Breakdown, each part timed alone the way the configuration runs it (graphs for the fast path).
        time_part = (lambda fn: _graph_ms(fn, device, 5)) if fast else (lambda fn: statistics.median(time_ms(fn, device, 5)))
        gemms = _gemms_of_a_step(model, full, device, dtype)
        out["gemm_ms"] = time_part(gemms)
        cache = session.cache
        H, D, F = rank_spec.n_heads, full.head_dim, full.frame_tokens
        q = torch.randn(H, F, D, device=device, dtype=dtype)
        if fast:
            from engine.kernels.rope_write import delta_rotate

            L, Hh, S, _ = cache.k.shape
            from engine.fused_block import stacked_gains

            b0 = model.blocks[0]
            head_norm = (stacked_gains(b0), b0.q_norm.eps)
            upkeep = _triton_upkeep(cache, full, q, head_norm=head_norm)

            def attend() -> None:  # as served: the output in e4m3
                for _ in range(full.passes):
                    for layer in range(L):
                        cache.attention(cache.q8, cache.k[layer], cache.vt[layer], cache.valid, cache.qk_scale[layer],
                                        cache.v_scale_out8[layer], cache.out8)

            # The upkeep and its variants: the frame write with the token blocks it had before (64 rows, 4 warps; now
            # 16 rows, 8 warps) and, where V's slots are in the ws kernel's order, what that order costs the write
            upkeeps = {"cache_upkeep_ms": upkeep,
                       "cache_upkeep_ms_write_blocks_of_64": _triton_upkeep(cache, full, q, head_norm=head_norm,
                                                                            block_t=64, num_warps=4)}
            if cache.v_positions is not None:
                upkeeps["cache_upkeep_ms_v_in_slot_order"] = _triton_upkeep(cache, full, q, head_norm=head_norm,
                                                                            pv_order=False)
            out.update(_in_turns(upkeeps, time_part, rounds=UPKEEP_ROUNDS), upkeep_rounds=UPKEEP_ROUNDS)
            out["attention_ms"] = time_part(attend)
            out["reset_rotation_ms"] = statistics.median(time_ms(
                lambda: delta_rotate(cache.k.view(L * Hh, S, D), cache._reset_cos_t, cache._reset_sin_t,
                                     cache.k_scale.view(-1), full.sink_slots), device, 5))
        else:
            L = full.n_blocks
            gathered = cache.gather(0, q, q)  # every layer's window has this shape; one copy keeps memory down

            def upkeep() -> None:
                for _ in range(full.passes):
                    for layer in range(L):
                        cache.gather(layer, q, q)

            def attend() -> None:
                for _ in range(full.passes):
                    for layer in range(L):
                        attention(q, *gathered)

            out["cache_upkeep_ms"] = time_part(upkeep)
            out["attention_ms"] = time_part(attend)
        out["other_ms"] = out["step_ms"] - out["gemm_ms"] - out["attention_ms"] - out["cache_upkeep_ms"]
        if fast and meter is not None:  # each part's energy a step, held back to back at the power limit as the step is
            out["part_energy"] = {name: sustained_energy(fn, device, meter, calls=1)
                                  for name, fn in (("gemm", gemms), ("attention", attend), ("cache_upkeep", upkeep))}
        session = model = cache = None  # let the GPU memory go before the next configuration
        return out

    with _optional(meter):
        result["serving"] = run_config(True)
        # Process-wide and read once by torch, so the baseline's bf16 GEMMs run with it too.
        from engine.kernels.fp8_linear import GEMM_WORKSPACE_ENV

        result["cublaslt_workspace_kib"] = os.environ.get(GEMM_WORKSPACE_ENV, "torch's default")
        result["baseline"] = run_config(False)
    result["speedup"] = result["baseline"]["step_ms"] / result["serving"]["step_ms"]
    result["ratios"] = {k: result["baseline"][k] / result["serving"][k]
                        for k in ("gemm_ms", "attention_ms", "cache_upkeep_ms") if result["serving"][k] > 0}
    return result


def _spawn_ranks(worker: Callable, world: int, *args) -> dict:
    """`world` processes of `worker(rank, world, port, *args, path)`; rank 0 writes its JSON result to path."""
    import tempfile

    import torch.multiprocessing as mp

    from engine.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/result.json"
        mp.spawn(worker, args=(world, free_port(), *args, path), nprocs=world)
        with open(path) as f:
            return json.load(f)


def _step_group_worker(rank: int, world: int, port: int, spec_name: str, steps: int, warmup: int, path: str) -> None:
    import torch.distributed as dist

    from engine.distributed import apply_symmetric_combine
    from engine.fused_block import FusedBlock

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device)
    full = get_spec(spec_name)
    model = random_shard(full, world, device, torch.bfloat16, fp8_gemms=True, seed=rank)
    ref_latent = torch.randn(full.latent_channels, *full.latent_grid, device=device, dtype=torch.bfloat16)
    audio = torch.zeros(full.frames_per_latent, full.n_mels, device=device)

    def all_reduce(y: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y)
        return y

    fused: list[FusedBlock] = list(model.blocks)  # the shard's fused blocks, reduction left out

    def run(comm: str) -> dict:
        torch.cuda.reset_peak_memory_stats(device)
        # "none": the same tensor-parallel path with the reduction left out: what communication costs
        reduce = (lambda y: y) if comm == "none" else all_reduce
        for index, block in enumerate(fused):
            model.blocks[index] = block.variant(reduce=reduce)
        if comm.startswith("symmetric tiles"):
            apply_symmetric_combine(model, full.frame_tokens, device, push=comm.endswith("push"))
        session = new_session(model, SERVED)
        session.start(ref_latent)
        times, resets = _timed_steps(session, audio, steps, warmup, device, resets=True,
                                     before_step=lambda: dist.barrier(device_ids=[rank]))
        out = {**_step_stats(times, resets), "steps_timed": len(times),
               "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9}
        del session
        torch.cuda.empty_cache()
        return out

    result = {"bench": "step", "date": time.strftime("%Y-%m-%d"), "spec": full.name, "world": world,
              "communication": "included: one all-reduce per block across the diffusion GPUs",
              "path": "ring FP8 cache, FP8 attention, FP8 GEMMs, CUDA graph", "device": _device_name(device),
              "torch": torch.__version__}
    with torch.no_grad():
        for comm in ("none", "nccl", "symmetric tiles", "symmetric tiles push"):
            result[comm.replace(" ", "_")] = run(comm)
    none = result["none"]["step_ms"]
    result["communication_ms"] = {k: result[k]["step_ms"] - none for k in ("nccl", "symmetric_tiles", "symmetric_tiles_push")}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def bench_step_group(spec_name: str, world: int, steps: int, warmup: int) -> dict:
    """The step on `world` GPUs, one tensor-parallel rank each, communication included: the reduction
    left out, plain NCCL, and the fused GEMM + all-reduce over symmetric memory, in one run."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        raise ValueError(f"--world {world} needs {world} visible GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if get_spec(spec_name).n_heads % world:
        raise ValueError(f"--world {world} must divide the {get_spec(spec_name).n_heads} heads of {spec_name}")
    return _spawn_ranks(_step_group_worker, world, spec_name, steps, warmup)


ATTENTION_REL_ERR = 3e-2  # relative error against attention_reference that tests/kernels/test_fp8_attention_ws.py allows
# ... and for P as log-linear e4m3 codes (exp2="e4m3_bits"): its codes lie up to 7.5% off 2^x where the nearest
# e4m3 value lies 5.9% off, so its error is larger by construction; what allows it is its change to the served
# clips, within the rerun band (docs/quality.md). tests/kernels/test_fp8_attention_ws.py holds it to this bound.
ATTENTION_REL_ERR_LOG_LINEAR = 4e-2


def attention_error_bound(config: dict) -> float:
    """The relative error against exact attention a configuration may have and still be picked."""
    return ATTENTION_REL_ERR_LOG_LINEAR if config.get("exp2") == "e4m3_bits" else ATTENTION_REL_ERR


def fastest_correct(configs: list[dict]) -> dict:
    """The fastest timed configuration whose output matched the reference; a fast but wrong one is
    listed in the results, never chosen."""
    ok = [c for c in configs if "us" in c and c["rel_err"] <= attention_error_bound(c)]
    if not ok:
        raise RuntimeError(f"no attention configuration matched the reference within its bound "
                           f"({ATTENTION_REL_ERR}, log-linear P {ATTENTION_REL_ERR_LOG_LINEAR}): {configs}")
    return min(ok, key=lambda c: c["us"])


@torch.no_grad()
def attention_inputs(H: int, M: int, S: int, D: int, device: torch.device, seed: int) -> tuple:
    """Unit-RMS q (H, M, D), k and v (H, S, D), their e4m3 forms (q8, k8, Vᵀ as (H, D, S)) and the per-head scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = fp8.per_head_scale(torch.ones(H, D, device=device))
    q, k, v = rms_heads(g, H, M, D), rms_heads(g, H, S, D), rms_heads(g, H, S, D)
    q8, k8, vt8 = fp8.quantize(q, scale), fp8.quantize(k, scale), fp8.quantize(v, scale).transpose(1, 2).contiguous()
    return (q, k, v), (q8, k8, vt8), scale


def bench_attention(spec_name: str, tp: int, device: torch.device, repeats: int) -> dict:
    """One attention call at the production shape: FP8 kernel configurations vs SDPA in bf16."""
    from engine.kernels import attention_kernel, make_attention
    from engine.kernels.fp8_attention import attention_reference, out_scale, qk_scale

    spec = shard_spec(get_spec(spec_name), tp)
    H, M, D = spec.n_heads, spec.frame_tokens, spec.head_dim
    S = -(-spec.cache_slots // 64) * 64  # as the ring stores them; the padding is masked
    (q, k, v), (q8, k8, vt8), scale = attention_inputs(H, M, S, D, device, seed=0)
    # Live as in the ring: the reference's K/V, then the window's frames; the sink's padding slots
    # (sink_slots - reference tokens) and the slots past cache_slots stay masked.
    live = torch.zeros(S, dtype=torch.bool, device=device)
    live[: spec.reference_tokens] = True
    live[spec.sink_slots : spec.cache_slots] = True
    valid = live.to(torch.int8)
    n_live = int(live.sum())
    live_idx = live.nonzero().squeeze(1)  # SDPA reads exactly the live slots
    qb, kb, vb = q.bfloat16()[None], k[:, live_idx].bfloat16()[None], v[:, live_idx].bfloat16()[None]
    # Every kernel timed as a CUDA graph of 20 calls: launched from Python, the Gluon kernel's launcher (descriptors,
    # argument checks) outlasts the kernel itself and the timing measured the host (82 us against 62 us in a graph).
    sdpa_call = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
    ref = attention_reference(q8, k8, vt8, valid, scale, scale, scale)
    out = torch.empty(M, H * D, device=device, dtype=torch.bfloat16)
    qks = qk_scale(scale, scale, D)
    configs = []
    # Tile shapes and pipeline depths, each with: the softmax's 2^x on the special-function unit, on the
    # FMA units, or half on each; the accumulator rescaled lazily; the KV axis split (more programs than SMs);
    # K and V tiles fetched by the copy engine (TMA, where the tiles divide the slots).
    variants = (("mufu", False, 1, False), ("mixed", False, 1, False), ("fma", False, 1, False), ("mufu", True, 1, False),
                ("mufu", False, 2, False), ("mufu", False, 1, True), ("mixed", False, 1, True))
    sweep = [dict(block_m=64, block_n=bn, num_warps=4, num_stages=st, splits=sp, exp2=e, lazy_rescale=lazy, tma=tma)
             for bn in (64, 128) for st in (3, 4) for e, lazy, sp, tma in variants if not (tma and S % (sp * bn))]
    sweep += [dict(block_m=128, block_n=128, num_warps=8, num_stages=st, splits=1, exp2=e) for st in (3, 4) for e in ("mufu", "mixed")]
    sweep += [dict(block_m=128, block_n=64, num_warps=8, num_stages=3, splits=1, exp2=e, tma=True) for e in ("mufu", "mixed")
              if S % 64 == 0]
    # P x V in fp16 (V widened): half the MMA rate, but P stays in the accumulator's register layout, where
    # an e4m3 P must first be shuffled into the layout of an FP8 operand.
    sweep += [dict(block_m=64, block_n=bn, num_warps=4, num_stages=3, splits=1, exp2="mufu", pv_fp8=False) for bn in (64, 128)]
    sweep = [{"kernel": "triton", **o} for o in sweep]
    if attention_kernel("auto", device, D) == "ws":  # the warp-specialised Hopper kernel: tile shapes, pipeline depths
        sweep += [dict(kernel="ws", block_m=64, block_n=bn, stages=st) for bn, st in ((128, 2), (128, 3), (64, 3), (64, 4))]
        sweep += [dict(kernel="ws", block_m=128, block_n=128, stages=st, pingpong=pp) for st in (2, 3) for pp in (False, True)]
        # P shuffled into the P·V operand's layout at every block instead of renamed in place (V's slots in their own order)
        sweep += [dict(kernel="ws", block_m=bm, block_n=128, stages=2, renamed_p=False) for bm in (64, 128)]
        # row maxima by the plain reduction (one dependent chain per row) instead of the tree
        sweep += [dict(kernel="ws", block_m=64, block_n=128, stages=st, tree_max=False) for st in (2, 3)]
        # the softmax's 2^x half or wholly on the FMA units (a polynomial) instead of the special-function unit
        sweep += [dict(kernel="ws", block_m=64, block_n=128, stages=st, exp2=e) for st in (2, 3) for e in ("mixed", "fma")]
        # P's row sums on the tensor cores (P·1), alone and with 2^x written as log-linear e4m3 codes
        sweep += [dict(kernel="ws", block_m=bm, block_n=128, stages=2, row_sum="tensor") for bm in (64, 128)]
        sweep += [dict(kernel="ws", block_m=bm, block_n=128, stages=st, row_sum="tensor", exp2="e4m3_bits")
                  for bm in (64, 128) for st in (2, 3)]
        # and the output written through shared memory by the copy engine instead of stored from registers
        sweep += [dict(kernel="ws", block_m=128, block_n=128, stages=2, row_sum="tensor", exp2="e4m3_bits", tma_out=True)]
    for opts in sweep:
        if opts["kernel"] == "triton":
            opts = {"pv_fp8": True, **opts, "warp_specialize": False}
        try:
            options = {k: v for k, v in opts.items() if k != "kernel"}
            att = make_attention(opts["kernel"], H, M, S, D, device, **options)
            att.mark_live_tiles(valid)
            vt = att.arrange_v(vt8)
            out.fill_(float("nan"))  # a configuration that missed rows must not pass on the previous one's output
            fn = lambda: att(q8, k8, vt, valid, qks, scale, out)
            ms = graph_call_ms(fn, device, repeats)
            err = ((out.float() - ref).norm() / ref.norm()).item()
        except Exception as e:  # a configuration the compiler rejects (shared memory, registers)
            configs.append({**opts, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        configs.append({**opts, "us": 1000 * ms, "rel_err": err})
    best = fastest_correct(configs)
    # As served: the same configuration writing its output in e4m3 at `out_scale` (the fused block's out-projection
    # reads it with no quantisation pass). SDPA's bf16 output would need that pass, so the target stays like for like.
    served = make_attention(best["kernel"], H, M, S, D, device, **{k: v for k, v in best.items() if k not in ("us", "rel_err", "kernel")})
    served.mark_live_tiles(valid)
    vt = served.arrange_v(vt8)
    o_scale = out_scale(scale, S)
    out8 = torch.full((M, H * D), float("nan"), device=device, dtype=torch.bfloat16).to(fp8.FP8)
    v_scale8 = scale / o_scale  # made once: a kernel of its own in the timed call would be timed too
    served_call = lambda: served(q8, k8, vt, valid, qks, v_scale8, out8)
    best_call = lambda: served(q8, k8, vt, valid, qks, scale, out)
    # The ratios from SDPA and the fastest timed in turns: over the sweep the GPU's clock drifts, and SDPA timed
    # once before it would carry the drift of its place in the order

    def after_a_pause(fn: Callable[[], None]) -> float:
        _sync(device)
        time.sleep(ATTENTION_PAUSE_S)
        return graph_call_ms(fn, device, repeats)

    paired = _in_turns({"sdpa": sdpa_call, "fp8": best_call, "fp8_e4m3_out": served_call}, after_a_pause, ATTENTION_ROUNDS)
    sdpa = paired["sdpa"]
    e4m3 = {**best, "out": "e4m3", "us": 1000 * paired["fp8_e4m3_out"],
            "rel_err": ((out8.float() * o_scale - ref).norm() / ref.norm()).item()}
    grid = grid_fill(best, M, S, D, valid, device, repeats) if best["kernel"] == "ws" else None
    best = {**best, "us": 1000 * paired["fp8"], "us_in_sweep": best["us"]}
    flops = 4 * H * M * n_live * D
    # Energy per call, each run back to back for seconds: in the served step the GPU sits at its power limit,
    # where a call's energy, more than its time alone, sets what it costs the step
    meter = EnergyMeter.open(device)
    with _optional(meter):
        energy = {"sdpa_bf16": sustained_energy(sdpa_call, device, meter),
                  "fp8_best": sustained_energy(best_call, device, meter),
                  "fp8_best_e4m3_out": sustained_energy(served_call, device, meter)}
        if meter is not None:
            energy["power_limit_w"] = meter.power_limit_w()
            sdpa_joules = energy["sdpa_bf16"]["joules_per_call"]
            energy["sdpa_over_fp8_joules"] = sdpa_joules / energy["fp8_best_e4m3_out"]["joules_per_call"]
            energy["sdpa_over_fp8_bf16_out_joules"] = sdpa_joules / energy["fp8_best"]["joules_per_call"]
    return {"bench": "attention", "date": time.strftime("%Y-%m-%d"), "spec": spec_name, "tp_shard": tp,
            "timing": f"per call, from CUDA graphs of 20 calls; median of {repeats} replays; SDPA and the fastest FP8 "
                      f"configuration: the median of {ATTENTION_ROUNDS} such timings, taken in turns, each after "
                      f"{1000 * ATTENTION_PAUSE_S:.0f} ms idle",
            "shape": {"heads": H, "queries": M, "slots": S, "live_slots": n_live, "head_dim": D},
            "device": _device_name(device), "torch": torch.__version__, "sdpa_bf16_us": 1000 * sdpa, "fp8_best": best,
            "speedup": 1000 * sdpa / best["us"], "fp8_tflops": flops / best["us"] / 1e6, "sdpa_tflops": flops / sdpa / 1e9,
            "fp8_best_e4m3_out": e4m3, "speedup_e4m3_out": 1000 * sdpa / e4m3["us"], "grid_fill": grid,
            "energy": energy if meter is not None else None,
            "configs": configs}


def grid_fill(best: dict, M: int, S: int, D: int, valid: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """The fastest ws configuration on the same queries and slots with the head count changed, so that its programs
    fill the GPU once, exactly (every SM holding as many as it can, `programs_per_sm`), or just past that: how
    much of the production call's time comes from how its programs spread over the SMs."""
    from engine.kernels import make_attention
    from engine.kernels.fp8_attention import qk_scale
    from engine.kernels.fp8_attention_ws import HOPPER_SM, compile_for_hopper, programs_per_sm

    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    options = {k: v for k, v in best.items() if k not in ("us", "rel_err", "kernel")}
    sm = {**HOPPER_SM, "shared_bytes": props.shared_memory_per_multiprocessor,
          "threads": props.max_threads_per_multi_processor}
    per_sm = programs_per_sm(compile_for_hopper(D, **options), sm)  # registers, shared memory, threads
    m_blocks = -(-M // best["block_m"])
    rows = []
    for heads in sorted({max(1, sms // m_blocks), -(-per_sm * sms // m_blocks), -(-per_sm * sms // m_blocks) + 1}):
        _, (q8, k8, vt8), scale = attention_inputs(heads, M, S, D, device, seed=1)
        att = make_attention("ws", heads, M, S, D, device, **options)
        att.mark_live_tiles(valid)
        vt, qks = att.arrange_v(vt8), qk_scale(scale, scale, D)
        out = torch.empty(M, heads * D, device=device, dtype=torch.bfloat16)
        us = 1000 * graph_call_ms(lambda: att(q8, k8, vt, valid, qks, scale, out), device, repeats)
        rows.append({"heads": heads, "programs": heads * m_blocks, "us": us})
    return {"sms": sms, "programs_per_sm": per_sm, "rows": rows}


# block_m, block_n, warps, stages, reducers (0: every program multiplies and reduces; else programs that only
# reduce), push (partials written into every rank's buffer instead of pulled from each)
TILE_SWEEP = ((128, 128, 8, 4, 0, False), (128, 128, 8, 4, 0, True), (128, 128, 8, 4, 12, True), (64, 256, 4, 4, 0, True))


def _allreduce_worker(rank: int, world: int, port: int, device_type: str, repeats: int, chunks: int, path: str) -> None:
    """Every way of making a block's combine at the production shape, timed on each rank (rank 0 reports).

    plain: the MLP-out GEMM, the gated sum, one NCCL all-reduce. row chunks: the same with each
    chunk of rows reduced while the next is multiplied. symmetric tiles (GPUs): one kernel that
    multiplies tile by tile and sums each tile from every rank's symmetric buffer (engine/kernels/
    gemm_allreduce.py), in bf16 and with FP8 operands. Hidden share: (GEMM alone + all-reduce alone
    - fused) / all-reduce alone."""
    import torch.distributed as dist

    from engine.distributed import OverlappedCombine

    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, **({"device_id": device} if device.type == "cuda" else {}))
    spec = get_spec("characters-57b")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, hidden = spec.frame_tokens, spec.mlp_hidden // world

    class _Block(torch.nn.Module):  # just the row-parallel MLP-out of one rank
        def __init__(self):
            super().__init__()
            self.mlp_out = torch.nn.Linear(hidden, spec.dim, bias=False, device=device, dtype=dtype)

    g = torch.Generator(device=device).manual_seed(rank)
    block = _Block()
    a = torch.randn(rows, spec.dim, device=device, dtype=dtype, generator=g)
    s = torch.randn(rows, hidden, device=device, dtype=dtype, generator=g)
    ga = torch.randn(spec.dim, device=device, dtype=dtype, generator=g)
    gm = torch.randn(spec.dim, device=device, dtype=dtype, generator=g)
    w = block.mlp_out.weight
    fused = OverlappedCombine(rows, chunks=chunks, warmup=0)
    y = torch.empty(rows, spec.dim, device=device, dtype=dtype)

    def plain() -> torch.Tensor:
        y = ga * a + gm * block.mlp_out(s)
        dist.all_reduce(y)
        return y

    variants = {"unfused_us": plain, "row_chunks_us": lambda: fused(block, a, s, ga, gm),
                "gemm_us": lambda: ga * a + gm * block.mlp_out(s), "allreduce_us": lambda: dist.all_reduce(y)}
    checks: dict = {}
    if device.type == "cuda":
        from engine.kernels.fp8_linear import FP8Linear, quantize_rows
        from engine.kernels.fused_block import gated_sum
        from engine.kernels.gemm_allreduce import SymmetricGemmAllReduce

        from engine.kernels.gemm_allreduce import launch, new_flags

        lin8 = FP8Linear(block.mlp_out)
        s8, ss = quantize_rows(s)
        fp8_in = dict(row_scale=ss.view(-1), col_scale=lin8.weight_scale.view(-1).contiguous())
        epi = dict(gate=gm, residual=a, residual_gate=ga)
        operands = {"bf16": (s, w, epi), "fp8": (s8, lin8.weight8, {**epi, **fp8_in})}
        local = torch.tensor([y.data_ptr()], dtype=torch.int64, device=device)  # world 1: the GEMM part alone

        def plain_fp8() -> torch.Tensor:
            y = gated_sum(a, lin8.forward_quantized(s8, ss), ga, gm)
            dist.all_reduce(y)
            return y

        variants.update({"unfused_fp8_us": plain_fp8, "gemm_fp8_us": lambda: gated_sum(a, lin8.forward_quantized(s8, ss), ga, gm)})
        sweep = {}  # tile shape and pipeline depth: the fused kernel at each, with its GEMM part alone
        with torch.no_grad():
            for block_m, block_n, num_warps, num_stages, reducers, push in TILE_SWEEP:
                op = SymmetricGemmAllReduce(rows, spec.dim, device, block_m=block_m, block_n=block_n,
                                            num_warps=num_warps, num_stages=num_stages, reducers=reducers, push=push)
                own_flags = new_flags(rows, spec.dim, 1, block_m=block_m, block_n=block_n).to(device)  # world 1's table
                own_flag_ptr = torch.tensor([own_flags.data_ptr()], dtype=torch.int64, device=device)
                for kind, (x_in, w_in, kw) in operands.items():
                    key = f"{kind} {block_m}x{block_n} w{num_warps} s{num_stages} r{reducers}{' push' if push else ''}"
                    fused_fn = lambda op=op, x_in=x_in, w_in=w_in, kw=kw: op(x_in, w_in, **kw)
                    alone = lambda op=op, x_in=x_in, w_in=w_in, kw=kw, f=own_flag_ptr: launch(
                        x_in, w_in, torch.empty_like(y), local, f, 0, 1, block_m=op.block_m, block_n=op.block_n,
                        programs=op.programs, **op.kernel_options, **kw)
                    ref = plain() if kind == "bf16" else plain_fp8()
                    err = ((fused_fn().float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    dist.barrier()
                    sweep[key] = {"fused_us": 1000 * event_ms(fused_fn, device, repeats),
                                  "gemm_alone_us": 1000 * event_ms(alone, device, repeats), "max_rel_diff_vs_nccl": err}
        checks["sweep"] = sweep
    timings = {}
    with torch.no_grad():
        for name, fn in variants.items():
            dist.barrier()
            if device.type == "cuda":  # back to back between events, as the calls run inside a step
                timings[name] = 1000 * event_ms(fn, device, repeats)
            else:
                timings[name] = 1000 * statistics.median(time_ms(fn, device, repeats, warmup=5))
    if rank == 0:
        def hidden_share(fused_key: str, gemm_key: str) -> float:
            return (timings[gemm_key] + timings["allreduce_us"] - timings[fused_key]) / timings["allreduce_us"]

        result = {"bench": "allreduce", "date": time.strftime("%Y-%m-%d"), "world": world, "device": _device_name(device),
                  "shape": [rows, spec.dim], "inner_dim": hidden, "dtype": str(dtype).removeprefix("torch."), "chunks": chunks,
                  "repeats": repeats, **timings,
                  "row_chunks": {"speedup": timings["unfused_us"] / timings["row_chunks_us"],
                                 "allreduce_hidden_share": hidden_share("row_chunks_us", "gemm_us")},
                  "torch": torch.__version__}
        if "sweep" in checks:  # the best tile configuration per operand type, against plain NCCL
            result["symmetric_tiles_sweep"] = checks["sweep"]
            for kind, plain_key, gemm_key in (("bf16", "unfused_us", "gemm_us"), ("fp8", "unfused_fp8_us", "gemm_fp8_us")):
                name, best = min(((k, v) for k, v in checks["sweep"].items() if k.startswith(kind)), key=lambda kv: kv[1]["fused_us"])
                ar = timings["allreduce_us"]
                result[f"symmetric_tiles_{kind}"] = {
                    "config": name, **best, "speedup_vs_plain": timings[plain_key] / best["fused_us"],
                    "allreduce_hidden_share": (timings[gemm_key] + ar - best["fused_us"]) / ar,
                    "allreduce_hidden_share_vs_own_gemm": (best["gemm_alone_us"] + ar - best["fused_us"]) / ar}
        with open(path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def bench_allreduce(device_type: str, world: int, repeats: int, chunks: int) -> dict:
    """Fused (overlapped) vs unfused MLP-out GEMM + all-reduce at the production shape (757 x 7680)."""
    if world < 2:
        raise ValueError(f"the all-reduce benchmark needs at least 2 processes (GPUs), got {world}")
    return _spawn_ranks(_allreduce_worker, world, device_type, repeats, chunks)


def bench_pipeline(spec_name: str, placement, steps: int, in_flight: int = 2) -> dict:
    """Step period with the decoder in its own process (and on its own GPU when placed so) vs diffusion time."""
    spec = get_spec(spec_name)
    feats = torch.zeros(spec.frames_per_latent, spec.n_mels)
    ref = torch.randn(spec.latent_channels, *spec.latent_grid)
    with start_processes(EngineOptions(), spec, placement, timeout=600) as engine:
        engine.start(ref)
        for t in range(in_flight):
            engine.submit_step(feats, t * spec.frames_per_latent)
        for t in range(steps):
            engine.next_frames()
            engine.submit_step(feats, (t + in_flight) * spec.frames_per_latent)
        timings = list(engine.timings)[max(3, steps // 5):]  # steady state
    delivered = [t["delivered"] for t in timings]
    period = statistics.median(1000 * (b - a) for a, b in zip(delivered, delivered[1:]))
    diffusion = statistics.median(t["step_ms"] for t in timings)
    decode = statistics.median(t["decode_ms"] for t in timings)
    return {"bench": "pipeline", "date": time.strftime("%Y-%m-%d"), "spec": spec.name,
            "placement": {"diffusion": list(placement.diffusion) or f"cpu x{placement.cpu_ranks}",
                          "decoders": list(placement.decoders) or "shares rank 0's device"},
            "steps_timed": len(timings), "period_ms": period, "diffusion_ms": diffusion, "decode_ms": decode,
            "period_minus_diffusion_ms": period - diffusion, "real_time_period_ms": 1000 * spec.step_seconds,
            "fps": 1000 * spec.frames_per_latent / period, "torch": torch.__version__}


def attention_options_arg(text: str) -> dict:
    """--attention-options: a JSON object whose "kernel", when given, is one the engine has; checked when the
    command line is read, not after minutes of building the model."""
    from engine.kernels import check_attention_kernel

    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, e.g. '{{\"kernel\": \"ws\"}}', got {text!r}")
    try:
        kernel = check_attention_kernel(options.get("kernel", "auto"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    from engine.kernels import attention_option_names

    known = attention_option_names(kernel)
    unknown = sorted(set(options) - known - {"kernel"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown option(s) {', '.join(unknown)} for the {kernel} attention kernel; "
                                         f"it takes {', '.join(sorted(known))}")
    return options


def gemm_kernels_args(mlp_in: str, qkv_mlp_out: str, attn_out: str = "auto") -> dict[str, str] | None:
    """--mlp-in-gemm, --qkv-mlp-out-gemm and --attn-out-gemm as bench_step's `gemm_kernels` (None: the engine's defaults)."""
    chosen = {} if mlp_in == "auto" else {"mlp_in": mlp_in}
    if qkv_mlp_out != "auto":
        chosen.update(qkv=qkv_mlp_out, mlp_out=qkv_mlp_out)
    if attn_out != "auto":
        chosen.update(attn_out=attn_out)
    return chosen or None


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench", description="talkloop engine benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    c = sub.add_parser("cache", help="per-step KV cache upkeep: naive vs ring")
    st = sub.add_parser("step", help="one rank's step of the 57b shape: serving path vs baseline, with a breakdown")
    at = sub.add_parser("attention", help="one attention call at the production shape: FP8 kernel vs SDPA bf16")
    ar = sub.add_parser("allreduce", help="MLP-out GEMM + all-reduce at 757 x 7680: overlapped vs plain")
    ar.add_argument("--world", type=at_least(2), default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    ar.add_argument("--chunks", type=at_least(1), default=4)
    pl = sub.add_parser("pipeline", help="step period with the decoder in its own process vs diffusion time")
    pl.add_argument("--gpus", default=None, help="e.g. 0,1,2,3 (default: all visible)")
    pl.add_argument("--decoder-gpu", default=None, help="e.g. 3")
    pl.add_argument("--steps", type=at_least(8), default=40, help="steps made; the first fifth (at least 3) warm up")
    st.add_argument("--steps", type=at_least(1), default=20)
    st.add_argument("--world", type=at_least(1), default=1,
                    help="GPUs, one tensor-parallel rank each, communication included (default: one rank's share, no communication)")
    st.add_argument("--warmup", type=at_least(0), default=3)
    st.add_argument("--branch-streams", choices=("on", "off"), default="on",
                    help="each block's MLP branch on a side stream beside its attention (the other setting is timed too)")
    st.add_argument("--fast-accum", choices=("on", "off"), default="on",
                    help="FP8 GEMMs with the tensor cores' fast accumulation (the other setting is timed too)")
    st.add_argument("--mlp-in-gemm", choices=("auto", "cublas", "triton"), default="auto",
                    help="MLP-in's FP8 product: cuBLAS, or the Triton kernel with SwiGLU in its epilogue (auto: Triton on "
                         "Hopper; the other is timed too)")
    st.add_argument("--qkv-mlp-out-gemm", choices=("auto", "cublas", "triton"), default="auto",
                    help="q/k/v's and MLP-out's FP8 products: cuBLAS, or the Triton kernel (auto: Triton on Hopper where "
                         "they and the out-projection tile in 256 columns and MLP-in is on Triton; the other is timed too)")
    st.add_argument("--attn-out-gemm", choices=("auto", "cublas", "triton"), default="auto",
                    help="the attention's out-projection's FP8 product: cuBLAS, or the Triton kernel (auto: as q/k/v's; "
                         "the other is timed too)")
    st.add_argument("--attention-options", default="{}", type=attention_options_arg, help="JSON: kernel (triton|ws), block_m, block_n, splits, num_warps, num_stages, exp2 (mufu|fma|mixed), lazy_rescale, tma; ws: block_m, block_n, stages, maxnreg, pingpong, renamed_p, tree_max, exp2 (also e4m3_bits), row_sum (fma|tensor), tma_out; ws options change the served ones (fp8_attention_ws.SERVED_OPTIONS) only where given")
    # each subcommand takes the flags it uses (the all-reduce benchmark is of the 57b shape only)
    for q, spec_default in ((c, "demo"), (st, "characters-57b"), (at, "characters-57b"), (pl, "demo")):
        q.add_argument("--spec", default=spec_default, choices=sorted(SPECS))
    for q in (c, st, at):
        q.add_argument("--tp-shard", type=at_least(1), default=1, help="benchmark one rank's share at this tensor-parallel degree")
    for q in (c, at, ar):
        q.add_argument("--repeats", type=at_least(1), default=10)
    for q in (c, st, at, ar, pl):
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = p.parse_args(argv)
    if args.bench == "step" and args.world > 1:  # the group times the served configuration, each rank its own shard
        ignored = [flag for flag, value, default in (("--tp-shard", args.tp_shard, 1), ("--attention-options", args.attention_options, {}),
                                                     ("--branch-streams", args.branch_streams, "on"), ("--fast-accum", args.fast_accum, "on"),
                                                     ("--mlp-in-gemm", args.mlp_in_gemm, "auto"),
                                                     ("--qkv-mlp-out-gemm", args.qkv_mlp_out_gemm, "auto"),
                                                     ("--attn-out-gemm", args.attn_out_gemm, "auto")) if value != default]
        if ignored:
            st.error(f"--world {args.world} times the served configuration on {args.world} ranks; it does not take {', '.join(ignored)}")
    try:
        if hasattr(args, "tp_shard"):
            spec = shard_spec(get_spec(args.spec), args.tp_shard)
        device = pick_device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if args.bench == "cache":
            result = bench_cache(spec, device, dtype, args.repeats)
            result["tp_shard"] = args.tp_shard
        elif args.bench == "allreduce":
            result = bench_allreduce(device.type, args.world, args.repeats, args.chunks)
        elif args.bench == "pipeline":
            from engine.distributed import Placement

            visible = torch.cuda.device_count() if device.type == "cuda" else 0
            pspec = get_spec(args.spec)
            placement = Placement.plan(args.gpus, args.decoder_gpu, visible=visible, n_heads=pspec.n_heads, mlp_hidden=pspec.mlp_hidden)
            result = bench_pipeline(args.spec, placement, args.steps)
        elif device.type != "cuda":
            raise ValueError(f"the {args.bench} benchmark needs a CUDA GPU")
        elif args.bench == "step" and args.world > 1:
            result = bench_step_group(args.spec, args.world, args.steps, args.warmup)
        elif args.bench == "step":
            result = bench_step(args.spec, args.tp_shard, device, args.steps, args.warmup, args.attention_options,
                                branch_streams=args.branch_streams == "on", fast_accum=args.fast_accum == "on",
                                gemm_kernels=gemm_kernels_args(args.mlp_in_gemm, args.qkv_mlp_out_gemm, args.attn_out_gemm))
        else:
            result = bench_attention(args.spec, args.tp_shard, device, args.repeats)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
