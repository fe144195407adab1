"""Per-turn latency traces.

Every hop of a turn stamps a named moment on one clock, time.monotonic(); the
engine and app add their own stamps (first_speaking_frame, client_delivered)
with `SessionTrace.mark`. Durations are derived under the names Pipecat and
LiveKit users know. Each finished turn is appended to a JSON-lines file and
flushed at once, so a crash loses at most the turn in flight; a stamp arriving
after a turn was written appends an updated record (the last line of a turn
id wins). Writing is best-effort: a full disk costs the trace, not the turn.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Stamps in the order a turn normally passes them.
STAMPS = (
    "speech_start",  # VAD: the user started speaking
    "last_voiced_audio",  # the last voiced chunk of the turn was fed (the user stopped speaking)
    "speech_end",  # VAD decided the turn is over (after min_silence_ms of silence)
    "asr_done",  # the final transcript is known
    "reply_start",  # the agent was asked (ahead of speech_end when the reply began at the user's pause)
    "reply_first_text",  # the agent produced its first text
    "tts_first_audio",  # the first reply audio was handed to the sink
    "first_speaking_frame",  # engine: first video frame driven by the reply audio
    "client_delivered",  # app: first reply audio/frame reached the client
)

# name: (from stamp, to stamp)
DURATIONS: dict[str, tuple[str, str]] = {
    "end_of_turn_delay": ("last_voiced_audio", "speech_end"),
    "stt": ("speech_end", "asr_done"),
    "llm_ttft": ("reply_start", "reply_first_text"),
    "tts_ttfb": ("reply_first_text", "tts_first_audio"),
    # LiveKit's sense: from the user going quiet to the first reply audio, silence wait included.
    "e2e_latency": ("last_voiced_audio", "tts_first_audio"),
    "speech_end_to_first_audio": ("speech_end", "tts_first_audio"),
    "e2e_latency_to_first_frame": ("last_voiced_audio", "first_speaking_frame"),
    "e2e_latency_to_client": ("last_voiced_audio", "client_delivered"),
}


def now() -> float:
    return time.monotonic()


@dataclass
class TurnTrace:
    session_id: str
    turn_id: int
    stamps: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    written: bool = False

    def mark(self, name: str, t: float | None = None, overwrite: bool = False) -> float:
        """Stamp a moment (default: now). The first stamp of a name is kept unless overwrite."""
        if overwrite or name not in self.stamps:
            self.stamps[name] = now() if t is None else float(t)
        return self.stamps[name]

    def durations(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, (start, end) in DURATIONS.items():
            if start in self.stamps and end in self.stamps:
                out[name] = round(self.stamps[end] - self.stamps[start], 4)
        return out

    def to_record(self) -> dict[str, Any]:
        ordered = {k: self.stamps[k] for k in STAMPS if k in self.stamps}
        ordered.update({k: v for k, v in self.stamps.items() if k not in ordered})
        return {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "clock": "time.monotonic",
            "wall_time": round(time.time(), 3),
            **self.info,
            "stamps": {k: round(v, 6) for k, v in ordered.items()},
            "durations_s": self.durations(),
        }


class SessionTrace:
    """All turns of one session, optionally mirrored to a JSON-lines file."""

    def __init__(self, path: str | os.PathLike | None = None, session_id: str | None = None) -> None:
        self.session_id = session_id or uuid.uuid4().hex[:12]
        self.path = Path(path) if path is not None else None
        self.turns: list[TurnTrace] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.error: str | None = None  # the first failed write, for the app to show
        self._line_open = False  # a write failed part-way: the file may end inside a line
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # so may a file an earlier run appended to when it died or filled the disk
            self._line_open = _ends_inside_a_line(self.path)

    def new_turn(self) -> TurnTrace:
        with self._lock:
            turn = TurnTrace(self.session_id, next(self._ids))
            self.turns.append(turn)
            return turn

    def get(self, turn_id: int) -> TurnTrace | None:
        with self._lock:
            return next((t for t in self.turns if t.turn_id == turn_id), None)

    def mark(self, turn_id: int, name: str, t: float | None = None) -> float:
        """Stamp a named moment on a turn, e.g. from the engine or the app."""
        turn = self.get(turn_id)
        if turn is None:
            raise KeyError(f"no turn {turn_id} in session {self.session_id}")
        value = turn.mark(name, t)
        if turn.written:
            self.write(turn)
        return value

    def write(self, turn: TurnTrace) -> None:
        """Append the turn's record and flush it to disk. An I/O error (a full disk, a folder gone) is kept in
        `error` and logged once, not raised: it runs where a turn's books are closed, which must go on."""
        turn.written = True
        if self.path is None:
            return
        line = json.dumps(turn.to_record(), sort_keys=False)
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    # after a write cut short, start on a line of its own so that this record stays readable
                    f.write(("\n" if self._line_open else "") + line + "\n")
                    f.flush()
                self._line_open = False
            except OSError as e:
                self._line_open = True
                if self.error is None:
                    self.error = f"turn trace not written to {self.path}: {e}"
                    log.error("%s", self.error)


def _ends_inside_a_line(path: Path) -> bool:
    """Whether the file at `path` is non-empty and its last byte is not a line break. A file that cannot be read
    (none yet, a folder) says no: writing to it reports its own error."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return False
            f.seek(end - 1)
            return f.read(1) != b"\n"
    except OSError:
        return False


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Turn records of a trace file, the last line of each (session, turn) winning. Lines that are not a turn
    record (one cut short by a crash or a full disk) are skipped, and their count logged."""
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = (str(record["session_id"]), int(record["turn_id"]))
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            latest[key] = record
    if skipped:
        log.warning("%s: skipped %d line(s) that are not turn records", path, skipped)
    return list(latest.values())


def summarize(values: list[float]) -> dict[str, float | int]:
    """Median and 95th percentile (nearest rank) of a list of seconds."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    p95 = ordered[min(n - 1, max(0, -(-95 * n // 100) - 1))]
    return {"n": n, "median": round(median, 4), "p95": round(p95, 4), "min": round(ordered[0], 4), "max": round(ordered[-1], 4)}
