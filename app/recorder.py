"""Recorded sessions: one folder each, with the video (MP4, H.264 + AAC), the turn trace
(JSON lines) and the transcript (JSON lines).

Every file is written as the session goes: the MP4 is fragmented (a fragment a second)
and each trace or transcript line is flushed, so a crash keeps all but the last moments.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.media import Mp4Writer

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
        self.error: str | None = None

    def _write_meta(self) -> None:
        # whole or not at all: a crash while it is rewritten at close keeps the one written at the start
        tmp = self.folder / (META + ".tmp")
        tmp.write_text(json.dumps(self.meta, indent=2) + "\n")
        tmp.replace(self.folder / META)

    def write_frame(self, rgb, pcm) -> None:
        if self.video is None:
            return
        try:
            self.video.write(rgb, pcm)
        except Exception as e:  # a full disk ends the video, not the conversation
            self.error = f"recording stopped: {e}"
            log.exception("recording failed")
            self._close_video()

    def add_line(self, role: str, turn_id: int, text: str, interrupted: bool = False) -> None:
        row = {"t": round(time.time(), 3), "turn_id": turn_id, "role": role, "text": text, **({"interrupted": True} if interrupted else {})}
        with open(self.folder / TRANSCRIPT, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def _close_video(self) -> None:
        video, self.video = self.video, None
        if video is not None:
            try:
                video.close()
            except Exception as e:
                self.error = self.error or f"recording could not be finished: {e}"

    def close(self, stats: dict[str, Any] | None = None) -> Path:
        self._close_video()
        self.meta.update(ended=time.time(), engine=stats or {}, error=self.error)
        self._write_meta()
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
        from voice.trace import read_jsonl

        path = self.folder / TRACE
        return sorted(read_jsonl(path), key=lambda r: int(r["turn_id"])) if path.is_file() else []

    def transcript(self) -> list[dict[str, Any]]:
        """The transcript's lines in order; where a turn's reply was written again (cut back after a barge-in),
        the last line of it, in the place of the first."""
        path = self.folder / TRANSCRIPT
        if not path.is_file():
            return []
        lines: dict[tuple, dict[str, Any]] = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if not isinstance(row, dict):
                continue
            key = (row.get("turn_id"), row.get("role")) if row.get("role") == "assistant" else (n,)
            if key in lines:
                lines[key].update(row)
            else:
                lines[key] = row
        return list(lines.values())


def list_recordings(root: str | Path) -> list[Recording]:
    """Recorded sessions under root, newest first."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir(), reverse=True):
        if not (folder / VIDEO).is_file():
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
