"""Playout buffer: releases frames on the 24 fps clock and absorbs slow steps.

The engine makes frames in bursts (4 per step); viewers need one every 1/24 s. The
buffer holds the engine's lead: playback starts once `prebuffer` frames wait, the
engine starts a step only while no more than `max_lead` frames wait (so latency stays
bounded), and a step may take as long as the waiting frames last: with `max_lead`
frames waiting, up to max_lead / fps seconds (7 frames: 292 ms, enough for the seed's
263 ms reset step).

`max_lead` is a ceiling. `adapt_lead` lowers the lead the engine keeps to what its
recent steps need (the slowest of them, with a margin): every frame waiting is time
that speech pushed now spends before it plays, so a fast engine keeps a short lead and
a slow one the whole of `max_lead`.

If a frame is due and none waits, that is an underrun: the picture holds, the
buffer refills to `prebuffer` and the clock restarts from there. The clock is
injectable so the behaviour can be checked without sleeping.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

RECENT_FRAMES = 120


@dataclass
class PlayoutStats:
    released: int = 0
    underruns: int = 0
    depth: int = 0
    first_release: float | None = None
    last_release: float | None = None
    # Release times of the latest frames (5 s at 24 fps): whether playback keeps up now, which an
    # average since the first frame (slow warm-up steps included) answers only late.
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_FRAMES))

    def fps(self, now: float | None = None) -> float:
        """Average release rate since the first frame played."""
        if self.first_release is None or self.released < 2:
            return 0.0
        end = now if now is not None else self.last_release
        span = end - self.first_release
        return (self.released - 1) / span if span > 0 else 0.0

    def recent_fps(self, now: float, period: float) -> float:
        """Release rate over the latest frames, up to `now`: a stall still going on counts (`period`: the
        time one frame stands on screen)."""
        if len(self.recent) < 2:
            return 0.0
        span = max(now, self.recent[-1] + period) - self.recent[0]
        return len(self.recent) / span


class PlayoutBuffer:
    def __init__(self, fps: float = 24.0, prebuffer: int = 4, max_lead: int = 7,
                 clock: Callable[[], float] = time.monotonic):
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        if prebuffer < 1 or max_lead < prebuffer:
            raise ValueError(f"need 1 <= prebuffer <= max_lead, got prebuffer={prebuffer}, max_lead={max_lead}")
        self.period = 1.0 / fps
        self.prebuffer, self.max_lead = prebuffer, max_lead
        self.lead = max_lead  # the engine may start a step while no more frames than this wait; <= max_lead
        self.clock = clock
        self.frames: deque[Any] = deque()
        self.next_due: float | None = None  # None while (re)buffering
        self.stats = PlayoutStats()
        self.closed = False
        self._cond = threading.Condition()

    # Producer side ---------------------------------------------------------------
    def put(self, frames: list[Any]) -> None:
        with self._cond:
            self.frames.extend(frames)
            self.stats.depth = len(self.frames)
            if self.next_due is None and len(self.frames) >= self.prebuffer:
                self.next_due = self.clock()
            self._cond.notify_all()

    def has_room(self) -> bool:
        """True when the engine may start its next step: while no more than `lead` frames wait, and while
        playback is waiting to (re)start, until `prebuffer` frames wait (a lead shorter than prebuffer
        would otherwise never let playback restart)."""
        return len(self.frames) <= self.lead or (self.next_due is None and len(self.frames) < self.prebuffer)

    def adapt_lead(self, slowest_step_s: float, margin: float = 1.25, guard: int = 1) -> int:
        """Set the lead to cover a step as slow as `slowest_step_s` (times `margin`, plus `guard` frames):
        the frames waiting when a step starts must last until its frames arrive. Never above max_lead."""
        if not slowest_step_s >= 0:
            raise ValueError(f"slowest_step_s must be a duration >= 0, got {slowest_step_s}")
        need = math.ceil(slowest_step_s * margin / self.period) + guard
        with self._cond:
            self.lead = max(1, min(self.max_lead, need))
            self._cond.notify_all()
        return self.lead

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block until the engine may start a step (or the buffer closes). Real-clock use only."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self.closed and not self.has_room():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(timeout=min(self.period, remaining) if remaining else self.period)
            return not self.closed

    def map_waiting(self, fn: Callable[[Any], Any]) -> None:
        """Rewrite frames not yet released (e.g. silence their audio on barge-in)."""
        with self._cond:
            self.frames = deque(fn(f) for f in self.frames)

    # Consumer side ---------------------------------------------------------------
    def pop_due(self, now: float | None = None) -> list[Any]:
        """Frames whose release time has come, in order; counts underruns."""
        now = self.clock() if now is None else now
        out = []
        with self._cond:
            while self.next_due is not None and now >= self.next_due:
                if not self.frames:
                    self.stats.underruns += 1
                    self.next_due = None  # hold the picture and refill
                    break
                out.append(self.frames.popleft())
                if self.stats.first_release is None:
                    self.stats.first_release = self.next_due
                self.stats.last_release = self.next_due
                self.stats.recent.append(self.next_due)
                self.stats.released += 1
                self.next_due += self.period
            if self.next_due is None and len(self.frames) >= self.prebuffer:
                self.next_due = now
            self.stats.depth = len(self.frames)
            if out:
                self._cond.notify_all()
        return out

    def head(self) -> tuple[Any | None, float]:
        """The first waiting frame (None when none waits) and when the next frame is released: its due time,
        or now while (re)buffering or when the consumer is late. Taken together, under one lock."""
        with self._cond:
            now = self.clock()
            due = now if self.next_due is None else max(self.next_due, now)
            return (self.frames[0] if self.frames else None), due

    def due_after_waiting(self) -> float | None:
        """When the frame after those waiting is due if playback runs on without a gap; None while
        (re)buffering."""
        with self._cond:
            if self.next_due is None:
                return None
            return max(self.next_due, self.clock()) + len(self.frames) * self.period

    def next_release(self) -> float | None:
        with self._cond:
            return self.next_due

    def get(self, timeout: float = 1.0) -> list[Any]:
        """Block (on the real clock) until at least one frame is due; [] on timeout or close."""
        deadline = time.monotonic() + timeout
        while not self.closed:
            due = self.pop_due()
            if due:
                return due
            nxt = self.next_release()
            now = self.clock()
            wait = (nxt - now) if nxt is not None else self.period
            if time.monotonic() + max(wait, 0) > deadline:
                return []
            with self._cond:
                self._cond.wait(timeout=max(min(wait, self.period), 0.001))
        return []

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
