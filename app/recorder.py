"""Recorded sessions: one folder each, with the video (MP4, H.264 + AAC), the turn trace
(JSON lines) and the transcript (JSON lines).

Every file is written as the session goes: the MP4 is fragmented (a fragment a second)
and each trace or transcript line is flushed, so a crash keeps all but the last moments.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.media import Mp4Writer
from engine.session_log import append_line

log = logging.getLogger(__name__)

VIDEO, TRACE, TRANSCRIPT, META = "session.mp4", "trace.jsonl", "transcript.jsonl", "session.json"


class SessionRecorder:
    def __init__(self, root: str | Path, session_id: str, fps: int, size: tuple[int, int], meta: dict[str, Any]):
        self.folder = Path(root).expanduser() / f"{time.strftime('%Y%m%d-%H%M%S')}-{session_id}"
        self.folder.mkdir(parents=True, exist_ok=False)
        self.trace_path = self.folder / TRACE
        self.meta = {"session_id": session_id, "started": time.time(), **meta}
        self._write_meta()
        self.video: Mp4Writer | None = Mp4Writer(self.folder / VIDEO, fps, size)
        # the pump writes frames while stop() may close the video (the pump's join can time out): FFmpeg must not
        # flush and close a file that another thread is encoding into
        self._video_lock = threading.Lock()
        self.error: str | None = None

    def _write_meta(self) -> None:
        # whole or not at all: a crash while it is rewritten at close keeps the one written at the start
        tmp = self.folder / (META + ".tmp")
        try:
            tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
            tmp.replace(self.folder / META)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def write_frame(self, rgb, pcm) -> None:
        with self._video_lock:
            if self.video is None:
                return
            try:
                self.video.write(rgb, pcm)
            except Exception as e:  # a full disk ends the video, not the conversation
                self.error = self.error or f"recording stopped: {e}"
                log.exception("recording failed")
                self._close_video_locked()

    def add_line(self, role: str, turn_id: int, text: str, interrupted: bool = False) -> None:
        """Append one line to the transcript. An I/O error (a full disk) is kept in `error`, not raised: the
        conversation goes on."""
        row = {"t": round(time.time(), 3), "turn_id": turn_id, "role": role, "text": text, **({"interrupted": True} if interrupted else {})}
        path = self.folder / TRANSCRIPT
        try:  # after a line cut short (a full disk, here or in an earlier process), on a line of its own
            append_line(path, json.dumps(row) + "\n")
        except OSError as e:
            log.error("transcript not written to %s: %s", path, e)
            self.error = self.error or f"transcript not written to {path}: {e}"

    def _close_video(self) -> None:
        with self._video_lock:
            self._close_video_locked()

    def _close_video_locked(self) -> None:
        video, self.video = self.video, None
        if video is not None:
            try:
                video.close()
            except Exception as e:
                self.error = self.error or f"recording could not be finished: {e}"

    def close(self, stats: dict[str, Any] | None = None, failure: str | None = None) -> Path:
        """Finish the video and rewrite session.json with the engine's figures and why the session ended
        (`failure`, None for a plain stop). Never raises for an I/O error: it is kept in `error`."""
        self._close_video()
        self.meta.update(ended=time.time(), engine=stats or {}, failure=failure, error=self.error)
        try:
            self._write_meta()
        except OSError as e:  # the session.json written at the start stays, whole
            log.error("session.json not rewritten in %s: %s", self.folder, e)
            self.error = self.error or f"session.json not rewritten in {self.folder}: {e}"
        return self.folder


@dataclass(frozen=True)
class Recording:
    folder: Path
    meta: dict[str, Any]

    @property
    def label(self) -> str:
        preset = self.meta.get("preset", "?")
        try:
            seconds = float(self.meta.get("ended") or 0) - float(self.meta.get("started") or 0)
        except (TypeError, ValueError):  # a session.json edited or damaged by hand
            seconds = 0.0
        length = f"{seconds:.0f} s" if seconds > 0 else "unfinished"
        return f"{self.folder.name} ({preset}, {length})"

    @property
    def video(self) -> Path:
        return self.folder / VIDEO

    def trace(self) -> list[dict[str, Any]]:
        """The turn records in turn order. Records whose turn_id is not a whole number or whose stamps are not
        numbers (a damaged file) are skipped, and their count logged, as read_jsonl does for unreadable lines."""
        from voice.trace import read_jsonl

        path = self.folder / TRACE
        if not path.is_file():
            return []
        records = read_jsonl(path)
        usable = [r for r in records if _is_int(r.get("turn_id")) and _are_stamps(r.get("stamps"))]
        if len(usable) < len(records):
            log.warning("%s: skipped %d turn record(s) whose turn_id is not a whole number or whose stamps are "
                        "not numbers", path, len(records) - len(usable))
        return sorted(usable, key=lambda r: r["turn_id"])

    def transcript(self) -> list[dict[str, Any]]:
        """The transcript's lines in order; where a turn's reply was written again (cut back after a barge-in),
        the last line of it, in the place of the first. Lines that are not a transcript line (one cut short by a
        crash or a full disk, a damaged one) are skipped, and their count logged."""
        path = self.folder / TRANSCRIPT
        if not path.is_file():
            return []
        lines: dict[tuple, dict[str, Any]] = {}
        skipped = 0
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not (isinstance(row, dict) and _is_int(row.get("turn_id"))
                    and isinstance(row.get("role"), str) and isinstance(row.get("text"), str)):
                skipped += 1
                continue
            key = (row["turn_id"], row["role"]) if row["role"] == "assistant" else (n,)
            if key in lines:
                lines[key].update(row)
            else:
                lines[key] = row
        if skipped:
            log.warning("%s: skipped %d line(s) that are not transcript lines", path, skipped)
        return list(lines.values())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _are_stamps(stamps: Any) -> bool:
    """A turn record's stamps: names to finite numbers of seconds."""
    return isinstance(stamps, dict) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in stamps.values())


def list_recordings(root: str | Path) -> list[Recording]:
    """Recorded sessions under root, newest first."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir(), reverse=True):
        try:
            if not (folder / VIDEO).is_file():
                continue
        except OSError as e:  # a folder this user cannot enter (made by another user): left out, not fatal
            log.warning("recording %s left out: %s", folder, e)
            continue
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError):
            meta = {}
        out.append(Recording(folder, meta if isinstance(meta, dict) else {}))
    return out


def find_recording(root: str | Path, name: str) -> Recording:
    for rec in list_recordings(root):
        if rec.folder.name == name:
            return rec
    raise ValueError(f"no recorded session named {name!r} under {root}")
