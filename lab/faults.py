"""Faults injected into a running session, to check that it reports them and recovers or ends cleanly.

    python -m lab.soak --spec tiny --seconds 20 --fault slow-step@5 --fault exhaust-buffer@10:1.5 --json

A fault is KIND@SECONDS[:ARG], SECONDS into the session:

    kill-decoder@T[:i]     SIGKILL decoder process i (default 0): needs the engine's processes
    kill-rank@T[:r]        SIGKILL diffusion rank r (default 0): needs the engine's processes
    corrupt-audio@T        push speech holding NaN samples: it must be refused, the session goes on
    exhaust-buffer@T[:s]   the engine stalls for s seconds (default 1.0): the playout buffer runs dry
    slow-step@T[:x]        one step takes x times (default 10) the median step so far
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

FAULT_KINDS = ("kill-decoder", "kill-rank", "corrupt-audio", "exhaust-buffer", "slow-step")
_DEFAULT_ARG = {"kill-decoder": 0.0, "kill-rank": 0.0, "corrupt-audio": 0.0, "exhaust-buffer": 1.0, "slow-step": 10.0}
KILLS = ("kill-decoder", "kill-rank")


@dataclass
class Fault:
    kind: str
    at: float  # seconds into the session
    arg: float
    injected_at: float | None = None  # session seconds when it took effect
    details: dict = field(default_factory=dict)

    def report(self) -> dict:
        return {"fault": f"{self.kind}@{self.at:g}", "kind": self.kind, "at_s": self.at, "arg": self.arg,
                "injected_at_s": self.injected_at, **self.details}


def parse_fault(text: str) -> Fault:
    """KIND@SECONDS[:ARG] -> Fault; ValueError naming what was wrong."""
    kind, sep, rest = text.strip().partition("@")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r} in {text!r}; known faults: {', '.join(FAULT_KINDS)}")
    if not sep:
        raise ValueError(f"fault {text!r} needs a time: {kind}@SECONDS[:ARG]")
    at_text, _, arg_text = rest.partition(":")
    try:
        at = float(at_text)
        arg = float(arg_text) if arg_text else _DEFAULT_ARG[kind]
    except ValueError:
        raise ValueError(f"fault {text!r}: time and argument must be numbers ({kind}@SECONDS[:ARG])") from None
    if not np.isfinite(at) or at < 0 or not np.isfinite(arg) or arg < 0:
        raise ValueError(f"fault {text!r}: time and argument must be finite and >= 0")
    if kind == "slow-step" and arg < 1:
        raise ValueError(f"fault {text!r}: a slow step is at least 1x the median step")
    if kind in KILLS and arg != int(arg):
        raise ValueError(f"fault {text!r}: the process index must be a whole number")
    return Fault(kind, at, arg)


class StepFaults:
    """The faults that act inside the engine thread (through `RealtimeCharacter.before_step`)."""

    def __init__(self, step_seconds):
        self.step_seconds = step_seconds  # recent step durations (the character's deque)
        self._armed: list[Fault] = []
        self._lock = threading.Lock()
        self.clock_zero = time.monotonic()

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._armed.append(fault)

    def __call__(self, step: int) -> None:
        with self._lock:
            # a slow step is a multiple of the median step: it waits, armed, until a step has been timed
            waiting = [f for f in self._armed if f.kind == "slow-step" and not self.step_seconds]
            armed, self._armed = [f for f in self._armed if f not in waiting], waiting
        for fault in armed:
            fault.injected_at = time.monotonic() - self.clock_zero
            if fault.kind == "slow-step":
                recent = sorted(self.step_seconds)
                median = recent[len(recent) // 2]
                delay = (fault.arg - 1.0) * median  # the step itself takes the other 1x
                fault.details.update(step=step, median_step_ms=1000 * median, added_ms=1000 * delay)
            else:  # exhaust-buffer: the engine stalls while the buffer drains
                delay = fault.arg
                fault.details.update(step=step, stall_ms=1000 * delay)
            time.sleep(delay)


def corrupt_audio(sample_rate: int = 16_000, seconds: float = 0.5) -> np.ndarray:
    """Speech-like samples with NaNs in them, as a broken decoder or driver might hand over."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    x = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    x[::97] = np.nan
    return x
