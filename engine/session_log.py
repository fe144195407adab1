"""The per-session frame-rate log: one JSON line per session (seconds, frames released, fps, underruns...),
appended so that a line cut short by a crash or a full disk never spoils the next. `python -m
lab.session_report` reads it."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import BinaryIO


def default_log() -> Path:
    return Path(os.environ.get("TALKLOOP_SESSION_LOG", Path.home() / ".cache" / "talkloop" / "sessions.jsonl"))


def record_session(stats: dict, path: str | Path | None = None) -> Path:
    """Append one session's figures (seconds, frames released, fps, underruns...) as a JSON line."""
    path = Path(path) if path is not None else default_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, json.dumps({"ended": time.time(), **stats}) + "\n")
    return path


def append_line(path: str | Path, line: str) -> None:
    """Append `line` (ending in a line break) to a JSON-lines file and flush it. An earlier write may have left
    the file ending inside a line (its process died, or the disk filled, mid-write): appended to that fragment,
    this line would be unreadable too, so it then starts on a line of its own."""
    try:
        opened = open(path, "a+b")
    except (PermissionError, io.UnsupportedOperation):  # a log that cannot be read back (no read permission, a
        opened = open(path, "ab")  # pipe): appended to as it is
    with opened as f:
        if f.readable() and _ends_inside_a_line(f):
            line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()


def _ends_inside_a_line(f: BinaryIO) -> bool:
    """Whether the file `f` is non-empty and its last byte is not a line break (never for a pipe: nothing to read
    back)."""
    if not f.seekable():
        return False
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return False
    f.seek(end - 1)
    return f.read(1) != b"\n"
