"""The engine's step on a CPU it shares: alone, beside a busy core, beside a Python thread, in each dtype.

    python -m lab.cpu_share --json                      # demo-cpu, shipped weights, this machine's CPU
    python -m lab.cpu_share --spec demo --steps 10 --json

In the app the engine shares the CPU with speech recognition, the language model, speech synthesis, the
media loop and the browser. This measures what that sharing does to one engine step (diffusion and
decode, as `make_step` runs it), in one process, each case in turn on the same character:

- threads 1 and all cores, float32 and (where torch has it on this CPU) bfloat16, alone;
- beside another process that keeps one core busy: an op split over threads waits for the slowest
  thread, so a busy core stalls all of them;
- beside a Python thread of this process busy 3 ms of every 10: the step's Python holds the GIL between
  ops, and waits for it behind that thread.

Medians (and p90) over --steps steps, after --warmup steps. JSON has the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from engine.build import build_engine
from engine.config import SPECS, get_spec
from engine.options import EngineOptions, cpu_has_bf16


def _spin_forever() -> None:
    while True:
        pass


@contextmanager
def busy_core() -> Iterator[None]:
    """Another process keeping one core busy while the block runs."""
    process = multiprocessing.get_context("spawn").Process(target=_spin_forever, daemon=True)
    process.start()
    try:
        time.sleep(0.5)  # started and spinning
        yield
    finally:
        process.kill()
        process.join()


@contextmanager
def python_thread(busy_s: float = 0.003, idle_s: float = 0.007) -> Iterator[None]:
    """A Python thread of this process running pure Python busy_s out of every busy_s + idle_s."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            while time.perf_counter() - started < busy_s:
                pass
            time.sleep(idle_s)

    thread = threading.Thread(target=run, name="cpu-share-python", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def alone() -> Iterator[None]:
    yield


def step_times(character, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        character.make_step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        character.make_step()
        times.append(time.perf_counter() - started)
    return times


def run(spec_name: str, steps: int, warmup: int) -> dict:
    spec = get_spec(spec_name)
    cores = os.cpu_count() or 1
    dtypes = ["float32", "bfloat16"] if cpu_has_bf16() else ["float32"]
    besides = {"alone": alone, "beside a busy core": busy_core, "beside a Python thread busy 30%": python_thread}
    speech = 0.1 * np.random.default_rng(0).standard_normal(16000 * 120).astype(np.float32)
    rows = []
    for dtype in dtypes:
        for threads in sorted({1, cores}):
            options = EngineOptions(name="cpu-share", spec=spec_name, device="cpu", kv_dtype="fp32", dtype=dtype,
                                    threads=threads)
            built = build_engine(options, spec, look="ada")
            try:
                built.character.push_audio(speech, 16000)
                for label, beside in besides.items():
                    with beside():
                        times = step_times(built.character, steps, warmup)
                    times.sort()
                    rows.append({"dtype": dtype, "threads": threads, "case": label,
                                 "step_ms_median": round(1000 * statistics.median(times), 1),
                                 "step_ms_p90": round(1000 * times[math.ceil(0.9 * len(times)) - 1], 1)})
            finally:
                built.close()
    return {"benchmark": "cpu_share: one engine step (diffusion + decode) on a shared CPU", "spec": spec_name,
            "steps": steps, "warmup": warmup, "real_time_step_ms": round(1000 * spec.frames_per_latent / spec.fps, 1),
            "cpu_count": cores, "machine": platform.processor() or platform.machine(), "cpu_has_bf16": cpu_has_bf16(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.cpu_share", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="demo-cpu", choices=sorted(SPECS))
    p.add_argument("--steps", type=int, default=20, help="steps timed in each case")
    p.add_argument("--warmup", type=int, default=3, help="steps made first in each case, not timed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    result = run(args.spec, args.steps, args.warmup)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for r in result["rows"]:
            print(f"{r['dtype']:9s} threads {r['threads']:2d}  {r['case']:32s} median {r['step_ms_median']:8.1f} ms"
                  f"  p90 {r['step_ms_p90']:8.1f} ms")
        print(f"real time needs a step every {result['real_time_step_ms']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
