"""Soak run: a real-time session driven by scripted turns, watched second by second.

    python -m lab.soak --spec demo --seconds 600 --json                       # the GPU soak
    python -m lab.soak --spec tiny --seconds 60 --record soak.mp4 --trace soak.jsonl --json
    python -m lab.soak --spec tiny --config fp8-cache,processes=true --seconds 20 --fault kill-decoder@8 --json

Turns repeat: `--speech` seconds of speech pushed to the character, then `--silence`
seconds of nothing. The session plays on the 24 fps clock (the playout buffer paces the
engine) and the run reports fps, underruns, step-time percentiles, host and GPU memory
over time with their least-squares slope (growth shows as a positive slope), and the
share of whole seconds that released fewer than 24 frames. Frames go to a fragmented
MP4 (`--record`) and every second, turn, fault and error to a JSON-lines trace
(`--trace`), flushed line by line: what was written survives any failure.

Faults (`--fault KIND@SECONDS[:ARG]`, see lab/faults.py) are injected on schedule;
the report says for each when it took effect and what followed. An engine failure ends
the session cleanly (recording closed, trace ended, report printed), or with `--restarts N`
a new engine takes over, up to N times. Exit status: 0 when the session ran its time,
1 when a failure ended it (or the engine, a recording or a trace could not start), 2 for bad
arguments, 130 when Ctrl-C ended it (the report still printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine.audio import SAMPLE_RATE
from engine.build import build_engine
from engine.options import EngineOptions
from engine.playout import PlayoutBuffer
from lab.faults import KILLS, Fault, StepFaults, corrupt_audio, parse_fault

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb(pid: int) -> float | None:
    """Resident memory of one process (Linux /proc), MB; None where it cannot be read."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return None


def slope_per_minute(times_s: list[float], values: list[float]) -> float | None:
    """Least-squares slope of values over time, per minute."""
    pts = [(t, v) for t, v in zip(times_s, values) if v is not None]
    if len(pts) < 3:
        return None
    t, v = np.array(pts, dtype=np.float64).T
    if np.ptp(t) <= 0:
        return None
    return float(np.polyfit(t / 60.0, v, 1)[0])


GROWTH_LIMIT_MB_PER_MIN = 1.0  # 10 MB over a 10-minute soak
GROWTH_MIN_SPAN_S = 60.0  # a slope over less than this is mostly start-up (allocators, caches), not a trend


def growth_verdict(slope_mb_per_min: float | None, limit: float = GROWTH_LIMIT_MB_PER_MIN,
                   span_s: float | None = None) -> str:
    """'no growth' while memory's slope stays within `limit` MB a minute; too few samples, or (`span_s`) samples
    over less than GROWTH_MIN_SPAN_S: too short to tell."""
    if slope_mb_per_min is None or (span_s is not None and span_s < GROWTH_MIN_SPAN_S):
        return "too short to tell"
    return "no growth" if slope_mb_per_min <= limit else f"grows {slope_mb_per_min:.2f} MB per minute (limit {limit:g})"


def percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    ms = np.asarray(seconds) * 1000.0
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "max": float(ms.max())}


class Trace:
    """JSON lines, flushed one by one (a crash loses at most the line being written)."""

    def __init__(self, path: str | Path | None, t0: float):
        self.t0 = t0
        self.file = open(path, "w") if path is not None else None
        self.error: str | None = None  # the first write that failed (a full disk): the trace stops there, the soak goes on

    def write(self, event: str, **fields) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps({"t": round(time.monotonic() - self.t0, 4), "event": event, **fields}) + "\n")
            self.file.flush()
        except OSError as e:
            self.error = str(e)
            self.close()

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError as e:
                self.error = self.error or str(e)


class RecordingFailed(Exception):
    """The MP4 could not be written (a full disk): the session ends, its report says so."""


class MemoryWatch:
    """Host RSS of this process and the engine's processes; GPU memory where there is a GPU."""

    def __init__(self, character):
        engine = getattr(character.steps, "engine", None)
        self.engine = engine
        self.local_cuda = engine is None and str(character.steps.device).startswith("cuda")
        self.local_device = character.steps.device  # cuda:N: the device the session runs on, not the current one
        self.devices = list(engine.placement.diffusion) + list(engine.placement.decoders) if engine is not None else []

    def sample(self) -> dict:
        pids = [os.getpid()] + (list(self.engine.pids().values()) if self.engine is not None else [])
        host = [rss_mb(p) for p in pids]
        out = {"host_mb": sum(h for h in host if h is not None) if any(h is not None for h in host) else None}
        if self.local_cuda:
            out["gpu_mb"] = torch.cuda.memory_allocated(self.local_device) / 2**20
        elif self.devices and torch.cuda.is_available():  # device-wide use: the ranks' memory is in other processes
            used = [torch.cuda.mem_get_info(d) for d in sorted(set(self.devices))]
            out["gpu_mb"] = sum(total - free for free, total in used) / 2**20
        else:
            out["gpu_mb"] = None
        return out


class LiveCharacter:
    """The character now playing, and the totals of those before it (an engine that failed and was restarted)."""

    def __init__(self, open_character, fps: int, step_faults: StepFaults, step_times: list[float]):
        self.open_character, self.fps, self.step_faults, self.step_times = open_character, fps, step_faults, step_times
        self.released_before = self.underruns_before = 0
        self.character = None

    def start(self) -> None:
        self.playout = PlayoutBuffer(fps=self.fps)
        built = self.open_character(self.playout)
        self.character, self.trained, self.close = built.character, built.trained, built.close
        self.character.on_step = lambda step, s: self.step_times.append(s)
        self.character.before_step = self.step_faults
        self.step_faults.step_seconds = self.character.step_seconds
        self.memory = MemoryWatch(self.character)
        self.character.start()

    def stop(self) -> None:
        if self.character is not None:
            self.character.stop()
            self.close()
            self.released_before += self.playout.stats.released
            self.underruns_before += self.playout.stats.underruns
            self.character = None

    @property
    def released(self) -> int:
        return self.released_before + (self.playout.stats.released if self.character is not None else 0)

    @property
    def underruns(self) -> int:
        return self.underruns_before + (self.playout.stats.underruns if self.character is not None else 0)


def soak(spec, config: EngineOptions, *, seconds: float, speech_s: float = 4.0, silence_s: float = 3.0, record: str | None = None,
         trace_path: str | None = None, faults: list[Fault] | None = None, seed: int = 0, weights: str | None = None,
         look: str = "ada", source: str | None = None, restarts: int = 0, progress=None) -> dict:
    """The session for `seconds`; an engine failure ends it cleanly, or, up to `restarts` times, a new
    engine takes over (turns go on; the gap shows as underruns and seconds below 24 fps)."""
    from lab.quality import default_audio_source, speech_clip

    faults = sorted(faults or [], key=lambda f: f.at)
    if seconds <= 0:
        raise ValueError(f"--seconds must be positive, got {seconds:g}")
    if speech_s <= 0 or silence_s < 0:
        raise ValueError(f"--speech must be > 0 and --silence >= 0, got {speech_s:g} and {silence_s:g}")
    if restarts < 0:
        raise ValueError(f"--restarts must be >= 0, got {restarts}")
    if any(f.kind in KILLS for f in faults) and not config.own_processes:
        raise ValueError("kill faults need the engine's own processes: use a config with processes=true or tp >= 2")
    for f in faults:
        if f.kind == "kill-rank" and int(f.arg) >= max(config.tp, 1):
            raise ValueError(f"fault {f.kind}@{f.at:g}:{int(f.arg)}: there is no rank {int(f.arg)} "
                             f"(ranks 0..{max(config.tp, 1) - 1})")
    source = source or default_audio_source()
    turns = [speech_clip(seed + i, speech_s, source) for i in range(4)]  # cycled

    def opener(playout):
        return build_engine(replace(config, weights=weights, noise_seed=seed), spec, look=look, playout=playout)

    step_times: list[float] = []
    step_faults = StepFaults([])
    fps, period = spec.fps, 1.0 / spec.fps
    writer = None
    trace = Trace(trace_path, time.monotonic())  # before the character starts: a bad path stops nothing running
    try:
        if record:  # PyAV only when recording: a soak without --record runs where it is not installed
            from engine.media import Mp4Writer

            writer = Mp4Writer(record, fps, spec.image_size)
        live = LiveCharacter(opener, spec.fps, step_faults, step_times)
        live.start()
    except BaseException:
        trace.close()
        if writer is not None:
            writer.close()
        raise
    t0 = trace.t0 = time.monotonic()
    step_faults.clock_zero = t0
    trace.write("start", spec=spec.name, config=config.describe(), trained_weights=live.trained, seconds=seconds,
                speech_s=speech_s, silence_s=silence_s, audio_source=source, restarts=restarts,
                faults=[f.report()["fault"] for f in faults])
    samples: list[dict] = []
    per_second: dict[int, int] = {}  # whole second since the first release -> frames released in it
    first_due = last_due = None
    recorded, turn, next_turn, next_sample, pending = 0, 0, 0.0, 1.0, list(faults)
    ended, error, failures = "ran its time", None, []
    try:
        while True:
            now = time.monotonic() - t0
            if now >= seconds:
                break
            try:
                if now >= next_turn:
                    live.character.push_audio(turns[turn % len(turns)], SAMPLE_RATE)
                    trace.write("turn", turn=turn, speech_s=speech_s)
                    turn += 1
                    next_turn += speech_s + silence_s
                while pending and now >= pending[0].at:
                    _inject(pending.pop(0), live, step_faults, trace, now)
                batch = live.playout.get(timeout=0.1)
                if live.character.error is not None:
                    raise RuntimeError(f"engine failed: {live.character.error}") from live.character.error
            except (RuntimeError, ValueError, OSError) as e:
                failures.append({"at_s": round(now, 3), "error": str(e).splitlines()[0]})
                trace.write("error", error=str(e))
                if len(failures) > restarts:
                    raise
                live.stop()
                live.start()  # a failure to start again ends the session (outer handler)
                failures[-1]["restarted_at_s"] = round(time.monotonic() - t0, 3)
                trace.write("restart", restart=len(failures), **failures[-1])
                continue
            if batch:
                if failures and "frames_again_at_s" not in failures[-1]:
                    failures[-1]["frames_again_at_s"] = round(time.monotonic() - t0, 3)
                due_last = live.playout.stats.last_release
                for i, frame in enumerate(batch):
                    due = due_last - (len(batch) - 1 - i) * period
                    first_due = due if first_due is None else first_due
                    last_due = due
                    second = int(due - first_due + 1e-6)
                    per_second[second] = per_second.get(second, 0) + 1
                    if writer is not None:
                        try:
                            writer.write(frame.rgb, frame.pcm)
                        except OSError as e:
                            raise RecordingFailed(str(e)) from e
                    recorded += 1
            if now >= next_sample:
                row = {"t": round(now, 3), "released": live.released, "underruns": live.underruns,
                       "depth": live.playout.stats.depth, "lead": live.playout.lead, "steps": len(step_times),
                       **live.memory.sample()}
                samples.append(row)
                trace.write("second", **row)
                if progress is not None:
                    progress(row)
                next_sample += 1.0
    except (RuntimeError, ValueError, OSError) as e:
        ended, error = "engine failure", str(e).splitlines()[0]
        if not failures or failures[-1]["error"] != error:
            trace.write("error", error=str(e))
    except RecordingFailed as e:
        ended, error = "recording failed", str(e).splitlines()[0]
        trace.write("error", error=f"recording: {e}")
    except KeyboardInterrupt:  # Ctrl-C: the report and the trace's end as far as the session went
        ended, error = "interrupted", "interrupted (Ctrl-C)"
    finally:
        session_end = time.monotonic()
        released, underruns = live.released, live.underruns
        live.stop()
        if writer is not None:
            try:
                writer.close()
            except OSError as e:  # the file keeps the fragments written before
                if ended != "recording failed":
                    ended, error = "recording failed", f"closing the recording: {str(e).splitlines()[0]}"
    injected = sorted(f.injected_at for f in faults if f.injected_at is not None)
    for f in faults:
        until = next((t for t in injected if f.injected_at is not None and t > f.injected_at), math.inf)
        _outcome(f, samples, ended, until, failures)
        trace.write("fault_outcome", **f.report())
    fps_played = (recorded - 1) / (last_due - first_due) if recorded >= 2 and last_due > first_due else 0.0
    # whole seconds from the first frame to the session's end: a stall at the end counts, its seconds at 0 frames
    whole = int(session_end - first_due + 1e-6) if first_due is not None else 0
    report = _report(spec, config, live.trained, source, seconds, time.monotonic() - t0, samples, per_second, whole,
                     step_times, fps_played, released, underruns, recorded, faults, ended, error, failures, record, trace_path)
    trace.write("end", **{k: report[k] for k in ("ended", "error", "restarts", "frames_recorded", "underruns", "fps")})
    trace.close()
    report["trace_error"] = trace.error
    return report


def _inject(fault: Fault, live: LiveCharacter, step_faults: StepFaults, trace: Trace, now: float) -> None:
    character = live.character
    fault.details["underruns_before"], fault.details["released_before"] = live.underruns, live.released
    if fault.kind in KILLS:
        engine = character.steps.engine
        index = int(fault.arg)
        name = f"talkloop-decoder-{index}" if fault.kind == "kill-decoder" else f"talkloop-diffusion-{index}"
        if name not in engine.pids():  # a fault that names no process is the fault's mistake, not the engine's failure
            fault.details["not_injected"] = f"no process {name}; have {', '.join(engine.pids())}"
            trace.write("fault", **fault.report())
            return
        engine.kill_process(name)
        fault.injected_at, fault.details["process"] = now, name
    elif fault.kind == "corrupt-audio":
        fault.injected_at = now
        try:
            character.push_audio(corrupt_audio(), SAMPLE_RATE)
            fault.details["refused"] = None  # would mean corrupt audio got in: reported as such
        except ValueError as e:
            fault.details["refused"] = str(e)
    else:
        step_faults.arm(fault)
    trace.write("fault", **fault.report())


def _outcome(fault: Fault, samples: list[dict], ended: str, until: float, failures: list[dict]) -> None:
    """What followed, up to the next fault (`until`): underruns, and whether frames kept coming."""
    d = fault.details
    start = fault.injected_at if fault.injected_at is not None else math.inf
    before = [s for s in samples if s["t"] < start]
    if before and fault.kind in ("slow-step", "exhaust-buffer"):  # armed before they act: count from the last sample before
        d["underruns_before"], d["released_before"] = before[-1]["underruns"], before[-1]["released"]
    after = [s for s in samples if start <= s["t"] < until]
    d["underruns_after"] = (after[-1]["underruns"] - d.get("underruns_before", 0)) if after else None
    d["frames_after"] = (after[-1]["released"] - d.get("released_before", 0)) if after else None
    if fault.injected_at is None:
        d["outcome"] = f"not injected: {d['not_injected']}" if "not_injected" in d else "not injected (the session ended first)"
    elif fault.kind in KILLS:
        failure = next((f for f in failures if f["at_s"] >= fault.injected_at), None)
        if failure is None:
            d["outcome"] = "not detected"
        elif "frames_again_at_s" in failure:
            d["detected_after_s"] = round(failure["at_s"] - fault.injected_at, 3)
            d["frames_again_after_s"] = round(failure["frames_again_at_s"] - fault.injected_at, 3)
            d["outcome"] = "reported; engine restarted; session went on"
        elif "restarted_at_s" in failure:
            d["detected_after_s"] = round(failure["at_s"] - fault.injected_at, 3)
            d["outcome"] = "reported; engine restarted; no frames from it before the session's end"
        else:
            d["detected_after_s"] = round(failure["at_s"] - fault.injected_at, 3)
            d["outcome"] = "reported; session ended cleanly"
    elif fault.kind == "corrupt-audio":
        # refused or not is the push's own answer; whether frames followed is the session's
        d["outcome"] = ("refused; session went on" if d["frames_after"] else "refused") if d.get("refused") else "NOT refused"
    else:
        recovered = bool(d["frames_after"]) and len(after) >= 2 and after[-1]["released"] > after[0]["released"]
        absorbed = d["underruns_after"] == 0
        d["outcome"] = ("absorbed by the playout buffer" if absorbed else "underrun reported; recovered") if recovered \
            else "no frames after it"


def _report(spec, config, trained, audio_source, seconds, wall, samples, per_second, whole_seconds, step_times, fps, released,
            underruns, recorded, faults, ended, error, failures, record, trace_path) -> dict:
    # Seconds with no frame at all (a stalled or restarting engine, to the very end) count as 0; the last, cut short by
    # the end, is left out.
    full = [per_second.get(k, 0) for k in range(whole_seconds)]
    warm = [s for s in samples if s["t"] >= min(10.0, 0.2 * seconds)]  # allocator warm-up left out of the slope
    host = [s["host_mb"] for s in samples]
    gpu = [s["gpu_mb"] for s in samples]
    host_slope = slope_per_minute([s["t"] for s in warm], [s["host_mb"] for s in warm])
    gpu_slope = slope_per_minute([s["t"] for s in warm], [s["gpu_mb"] for s in warm])
    span = warm[-1]["t"] - warm[0]["t"] if warm else 0.0
    return {
        "spec": spec.name, "config": config.describe(), "trained_weights": trained, "audio_source": audio_source,
        "seconds_asked": seconds,
        "wall_seconds": wall, "ended": ended, "error": error, "restarts": sum("restarted_at_s" in f for f in failures),
        "failures": failures, "fps": fps, "frames_released": released, "frames_recorded": recorded,
        "underruns": underruns, "steps": len(step_times), "step_ms": percentiles_ms(step_times),
        "whole_seconds": len(full), "seconds_below_24fps": sum(1 for n in full if n < spec.fps),
        "share_of_seconds_below_24fps": (sum(1 for n in full if n < spec.fps) / len(full)) if full else None,
        "memory": {
            "host_mb_first": next((h for h in host if h is not None), None), "host_mb_last": host[-1] if host else None,
            "host_mb_max": max((h for h in host if h is not None), default=None),
            "host_mb_per_minute": host_slope, "host_growth": growth_verdict(host_slope, span_s=span),
            "gpu_mb_first": gpu[0] if gpu else None, "gpu_mb_last": gpu[-1] if gpu else None,
            "gpu_mb_per_minute": gpu_slope,
            "gpu_growth": growth_verdict(gpu_slope, span_s=span) if any(g is not None for g in gpu) else None,
            "slope_from_s": warm[0]["t"] if warm else None,
        },
        "faults": [f.report() for f in faults], "record": record, "trace": trace_path,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    from engine import character as ch
    from engine.config import SPECS, get_spec
    from engine.options import CONFIG_PRESETS, parse_options

    p = argparse.ArgumentParser(prog="python -m lab.soak", description=__doc__.strip().splitlines()[0])
    p.add_argument("--spec", default="demo", choices=sorted(SPECS))
    p.add_argument("--config", default="fp8-cache", help=f"PRESET[,key=value...] or a JSON file; presets: {', '.join(CONFIG_PRESETS)}")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the session runs")
    p.add_argument("--speech", type=float, default=4.0, help="seconds of speech per turn")
    p.add_argument("--silence", type=float, default=3.0, help="seconds of silence after each turn")
    p.add_argument("--record", default=None, help="fragmented MP4 of everything played")
    p.add_argument("--trace", default=None, help="JSON-lines trace: every second, turn, fault and error")
    p.add_argument("--fault", action="append", default=[], help="KIND@SECONDS[:ARG], repeatable (lab/faults.py)")
    p.add_argument("--restarts", type=int, default=0, help="after an engine failure, start a new engine (this many times)")
    p.add_argument("--weights", default=None)
    p.add_argument("--preset", default="ada", help=f"character, one of {', '.join(ch.PRESETS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audio-source", default=None, choices=("espeak", "piper", "synth"))
    p.add_argument("--samples", action="store_true", help="keep the per-second samples in the printed report")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = p.parse_args(argv)
    try:
        spec = get_spec(args.spec)
        config = parse_options(args.config)
        ch.get_look(args.preset)
        faults = [parse_fault(f) for f in args.fault]
        for path in (args.record, args.trace):
            if path is not None and (not path or Path(path).is_dir()):
                raise ValueError(f"cannot write {path!r}: it is a folder (give a file)")
            if path is not None and not Path(path).parent.is_dir():
                raise ValueError(f"cannot write {path}: folder {Path(path).parent} does not exist")
        report = soak(spec, config, seconds=args.seconds, speech_s=args.speech, silence_s=args.silence,
                      record=args.record, trace_path=args.trace, faults=faults, seed=args.seed, weights=args.weights,
                      look=args.preset, source=args.audio_source, restarts=args.restarts,
                      progress=lambda row: print(json.dumps(row), file=sys.stderr, flush=True))
    except ValueError as e:  # bad arguments, found before or as the session starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # the engine could not start, or a file could not be made
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.samples:
        report.pop("samples")
    print(json.dumps(report))
    return {"ran its time": 0, "interrupted": 130}.get(report["ended"], 1)


if __name__ == "__main__":
    sys.exit(main())
