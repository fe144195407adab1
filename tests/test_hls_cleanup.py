"""The HLS fallback cleans up after itself: a stream's segment folder goes once the stream is over, what a killed
run left goes at the next start, and nothing that a running stream or anyone else owns is touched."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app.hls import LiveSegments, SegmentStream
from engine.audio import SAMPLE_RATE
from engine.realtime import AVFrame

ROOT = Path(__file__).resolve().parent.parent
FPS = 4  # LiveSegments makes 1-second segments: 4 frames each


def _frame(index: int) -> AVFrame:
    return AVFrame(index, np.zeros((32, 32, 3), np.uint8), np.zeros(SAMPLE_RATE // FPS, np.float32), False)


class FakeLive:
    """A live session as the HLS stream sees it: an id, listeners, whether it has ended. Its `frames` reach the
    stream as soon as the stream listens; by default a segment's worth and one more, which tells the segment is
    not the session's last."""

    def __init__(self, frames: int = FPS + 1, ended: bool = False) -> None:
        self.session_id = uuid.uuid4().hex[:10]
        self.closed = threading.Event()
        if ended:
            self.closed.set()
        self.frames = frames

    def add_listener(self, on_frame, on_turn) -> None:
        for i in range(self.frames):
            on_frame(_frame(i), 0.0)

    def remove_listener(self, *listeners) -> None:
        pass


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# A run of the app in its own process: one stream, its first segment printed, then `ending`.
_RUN = """
import sys, threading
from types import SimpleNamespace
import numpy as np
from app.hls import LiveSegments
from engine.audio import SAMPLE_RATE
from engine.realtime import AVFrame

class Live:
    session_id = "elsewhere0"
    closed = threading.Event()
    def add_listener(self, on_frame, on_turn):
        for i in range(5):
            on_frame(AVFrame(i, np.zeros((32, 32, 3), np.uint8), np.zeros(SAMPLE_RATE // 4, np.float32), False), 0.0)
    def remove_listener(self, *listeners):
        pass

segments = LiveSegments(SimpleNamespace(live=Live()), 4, root=sys.argv[1])
stream = segments.stream()
print(next(stream), flush=True)
"""


def _run_app(root: Path, ending: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN + ending, str(root)], capture_output=True, text=True, timeout=120,
                          check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_stream_that_ends_with_its_session_leaves_no_folder_behind(tmp_path):
    root = tmp_path / "hls"
    segments = LiveSegments(SimpleNamespace(live=FakeLive(frames=2 * FPS, ended=True)), FPS, root=root)
    there_when_yielded = [Path(path).exists() for path in segments.stream()]  # Gradio reads each one as it comes
    assert there_when_yielded == [True, True]
    assert _entries(root) == []


def test_a_stream_that_gradio_closes_leaves_no_folder_behind(tmp_path):
    root = tmp_path / "hls"
    segments = LiveSegments(SimpleNamespace(live=FakeLive()), FPS, root=root)
    stream = segments.stream()
    path = Path(next(stream))
    assert path.exists()
    stream.close()  # what Gradio does with a generator once its event ends or is cancelled
    assert not path.parent.exists()
    assert _entries(root) == []


def test_a_replaced_stream_removes_its_folder_and_the_new_one_plays_on(tmp_path):
    root = tmp_path / "hls"
    controller = SimpleNamespace(live=FakeLive())
    segments = LiveSegments(controller, FPS, root=root)
    first = segments.stream()
    first_path = Path(next(first))
    controller.live = FakeLive(frames=2 * FPS + 1)  # a new session (Start, a restart, another preset)
    second = segments.stream()
    second_path = Path(next(second))  # this stream replaces the first
    last_of_first = list(first)  # Gradio resumes the first one: its last frames make its last segment, and it ends
    assert len(last_of_first) == 1
    assert not first_path.parent.exists()
    assert second_path.exists()
    assert Path(next(second)).exists()  # the new stream runs on
    assert _entries(root) == [second_path.parent.name]
    second.close()
    assert _entries(root) == []


def test_a_stream_still_playing_when_the_app_exits_leaves_no_folder_behind(tmp_path):
    root = tmp_path / "hls"
    run = _run_app(root, "")  # exits with the stream suspended between two segments
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).is_relative_to(root)
    assert _entries(root) == []
    assert "Traceback" not in run.stderr


def test_a_killed_runs_folder_goes_at_the_next_start_but_a_playing_stream_and_foreign_files_stay(tmp_path):
    root = tmp_path / "hls"
    playing_segments = LiveSegments(SimpleNamespace(live=FakeLive(frames=2 * FPS + 1)), FPS, root=root)
    playing = playing_segments.stream()
    playing_path = Path(next(playing))
    (root / "notes").mkdir()
    (root / "notes" / "keep.txt").write_text("not the app's")
    (root / "readme.txt").write_text("not the app's")
    # another run of the app starts (and looks for leftovers) while this stream plays, then is killed mid-stream
    killed = _run_app(root, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftover = Path(killed.stdout.strip()).parent
    assert leftover.exists() and leftover.parent == root
    assert playing_path.exists()

    LiveSegments(SimpleNamespace(live=None), FPS, root=root)  # the app starts again
    assert not leftover.exists()
    assert playing_path.exists() and Path(next(playing)).exists()  # the stream playing here was left alone
    assert (root / "notes" / "keep.txt").read_text() == "not the app's"
    assert _entries(root) == sorted([playing_path.parent.name, "notes", "readme.txt"])
    playing.close()


def _refuse_unlink_under(root: Path, monkeypatch) -> None:
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if Path(path).is_relative_to(root):
            raise PermissionError(13, "Permission denied", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse)


def test_a_folder_that_cannot_be_removed_is_logged_once_and_the_stream_ends_normally(tmp_path, monkeypatch, caplog):
    root = tmp_path / "hls"
    segments = LiveSegments(SimpleNamespace(live=FakeLive(frames=2 * FPS, ended=True)), FPS, root=root)
    _refuse_unlink_under(root, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="app.hls"):
        paths = list(segments.stream())
    assert len(paths) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "app.hls"]
    assert len(warnings) == 1 and Path(paths[0]).parent.name in warnings[0], warnings


def test_a_segment_that_cannot_be_deleted_is_logged_once_and_the_stream_runs_on(tmp_path, monkeypatch, caplog):
    live = FakeLive(frames=3 * FPS, ended=True)
    stream = SegmentStream(live, tmp_path / "segments", FPS, keep=1)  # each new segment deletes the one before
    _refuse_unlink_under(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="app.hls"):
        paths = list(stream.segments(0.1))
    assert len(paths) == 3  # two deletions refused, the stream ran to the session's end
    warnings = [r.getMessage() for r in caplog.records if r.name == "app.hls"]
    assert len(warnings) == 1 and "segment_00000.ts" in warnings[0], warnings


def test_a_session_id_that_would_leave_the_root_is_refused(tmp_path):
    live = FakeLive()
    live.session_id = "../outside"
    segments = LiveSegments(SimpleNamespace(live=live), FPS, root=tmp_path / "hls")
    with pytest.raises(ValueError, match=r"session id '\.\./outside'"):
        next(segments.stream())
    assert _entries(tmp_path) == []  # nothing made, inside the root or out
