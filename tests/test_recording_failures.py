"""A session's recording under failure: a full disk at close or mid-line, an engine that fails to close,
damaged files on replay, a recording folder the app cannot read."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import threading
import time
from pathlib import Path

import av
import numpy as np

from app.latency import render_panel
from app.live import LiveSession
from app.recorder import (
    META,
    TRACE,
    TRANSCRIPT,
    Recording,
    SessionRecorder,
    find_recording,
    list_recordings,
)
from voice.loop import LoopEvent

NO_SPACE = "No space left on device"


class Character:
    """The character as stop() sees it: its figures for the session log."""

    def stop(self, session_log=None):
        return {"fps": 24.0}


class Engine:
    def __init__(self, fails: bool = False) -> None:
        self.fails, self.closed = fails, False

    def close(self) -> None:
        if self.fails:
            raise RuntimeError("talkloop-decoder-0 did not exit")
        self.closed = True


def _recorded_session(tmp_path: Path, engine: Engine | None = None) -> LiveSession:
    live = LiveSession(Character(), engine, "ada")
    live.recorder = SessionRecorder(tmp_path, live.session_id, 24, (32, 32), {"preset": "ada"})
    for i in range(30):
        live.recorder.write_frame(np.full((32, 32, 3), i, np.uint8), np.zeros(667 if i % 3 else 666, np.float32))
    return live


def _session_json_disk_full(monkeypatch) -> None:
    """Rewriting session.json fails part-way with a full disk."""
    write_text = Path.write_text

    def full(self: Path, text: str, *args, **kwargs) -> int:
        if self.name == META + ".tmp":
            write_text(self, text[:10], *args, **kwargs)
            raise OSError(errno.ENOSPC, NO_SPACE, str(self))
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)


def _decodable_frames(video: Path) -> int:
    with av.open(str(video)) as container:
        return sum(1 for _ in container.decode(video=0))


# 1. Closing is failure-safe --------------------------------------------------------------------------
def test_a_full_disk_when_session_json_is_rewritten_still_closes_the_session(tmp_path, monkeypatch):
    engine = Engine()
    live = _recorded_session(tmp_path, engine)
    _session_json_disk_full(monkeypatch)
    assert live.stop(None) == {"fps": 24.0}
    assert live.closed.is_set() and engine.closed  # the HLS stream ends; the engine's processes are gone
    assert "session.json" in live.recorder.error and NO_SPACE in live.recorder.error
    assert _decodable_frames(live.recorder.folder / "session.mp4") == 30  # the video was finished
    assert json.loads((live.recorder.folder / META).read_text())["preset"] == "ada"  # the one from the start, whole
    assert not list(live.recorder.folder.glob("*.tmp"))


def test_an_engine_that_fails_to_close_still_leaves_the_recording_closed_and_the_failure_shown(tmp_path):
    live = _recorded_session(tmp_path, Engine(fails=True))
    assert live.stop(None) == {"fps": 24.0} and live.closed.is_set()
    assert any("talkloop-decoder-0 did not exit" in e for e in live.stop_errors)
    meta = json.loads((live.recorder.folder / META).read_text())
    assert meta["ended"] > 0 and "talkloop-decoder-0 did not exit" in meta["failure"]


def test_closing_the_app_on_a_full_disk_closes_the_engine_host_and_shows_why(tmp_path, monkeypatch):
    from app.config import build_config
    from app.controller import Controller

    config = build_config(None, {"spec": "tiny", "device": "cpu", "recordings_dir": str(tmp_path / "rec"),
                                 "session_log": str(tmp_path / "sessions.jsonl"), "asr_model": str(tmp_path / "no-model")})
    controller = Controller(config)
    host = controller.host
    try:
        live = controller.start("ada", record=True)
        _session_json_disk_full(monkeypatch)
        controller.close()
        assert host._closed and live.closed.is_set()
        assert any("session.json" in f and NO_SPACE in f for f in controller.failures())
    finally:
        host.close()


# 3. A transcript line cut short costs only that line -------------------------------------------------
def test_a_transcript_line_cut_short_loses_only_itself(tmp_path):
    rec = SessionRecorder(tmp_path, "cut", 24, (32, 32), {})
    rec.add_line("user", 1, "first")
    with open(rec.folder / TRANSCRIPT, "a") as f:  # an earlier write (or another process) died mid-line
        f.write('{"t": 1, "turn_id": 1, "role": "assis')
    rec.add_line("user", 2, "second, written after space came back")
    rec.add_line("assistant", 2, "third")
    assert [(r["turn_id"], r["text"]) for r in Recording(rec.folder, {}).transcript()] == [
        (1, "first"), (2, "second, written after space came back"), (2, "third")]


# 4. A transcript that cannot be written is shown -----------------------------------------------------
def test_a_transcript_write_on_a_full_disk_is_kept_among_the_failures_and_the_session_goes_on(tmp_path, monkeypatch):
    import engine.session_log

    live = _recorded_session(tmp_path)
    space = {"left": False}

    class FullDisk:  # the first bytes of a line go out, then the disk is full
        def __init__(self, file) -> None:
            self.file = file

        def __getattr__(self, name):
            return getattr(self.file, name)

        def write(self, data):
            if space["left"]:
                return self.file.write(data)
            self.file.write(data[:5])
            self.file.flush()
            raise OSError(errno.ENOSPC, NO_SPACE)

    @contextlib.contextmanager
    def open_on_a_full_disk(*args, **kwargs):
        with open(*args, **kwargs) as f:
            yield FullDisk(f)

    monkeypatch.setattr(engine.session_log, "open", open_on_a_full_disk, raising=False)  # where the recorder appends
    live._on_voice_event(LoopEvent("user_final", 1, "what is your name?"))
    assert [(line.role, line.text) for line in live.transcript] == [("user", "what is your name?")]  # shown all the same
    path = live.recorder.folder / TRANSCRIPT
    assert live.recorder.error == f"transcript not written to {path}: [Errno {errno.ENOSPC}] {NO_SPACE}"
    space["left"] = True
    live._on_voice_event(LoopEvent("agent_done", 1, "I am Ada."))
    assert live.recorder.error.startswith("transcript not written")  # the first failure is the one kept
    assert [r["text"] for r in Recording(live.recorder.folder, {}).transcript()] == ["I am Ada."]


# 7. Damaged transcript and trace lines are skipped and counted ---------------------------------------
def test_damaged_transcript_and_trace_rows_are_skipped_counted_and_named(tmp_path, caplog):
    rec = SessionRecorder(tmp_path, "bad", 24, (32, 32), {"preset": "ada"})
    rec.write_frame(np.zeros((32, 32, 3), np.uint8), np.zeros(667, np.float32))
    rec.close({})
    (rec.folder / TRANSCRIPT).write_bytes(
        b'{"turn_id": 1, "role": "user", "text": "hi"}\n'
        b'\xff\xfe not UTF-8\n'
        b'{"turn_id": [1], "role": "assistant", "text": "a list for a turn"}\n'
        b'{"turn_id": 1, "role": "assistant", "text": "hello"}\n')
    good = {"session_id": "s", "turn_id": 2, "stamps": {"last_voiced_audio": 1.0, "tts_first_audio": 1.5}}
    rows = [good, {"session_id": "s", "turn_id": 3, "stamps": None},
            {"session_id": "s", "turn_id": 4, "stamps": {"last_voiced_audio": 1, "tts_first_audio": "2"}},
            {"session_id": "s", "turn_id": "5", "stamps": {}}]
    (rec.folder / TRACE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    replayed = find_recording(tmp_path, rec.folder.name)
    with caplog.at_level(logging.WARNING, logger="app.recorder"):
        assert [(r["role"], r["text"]) for r in replayed.transcript()] == [("user", "hi"), ("assistant", "hello")]
        assert [r["turn_id"] for r in replayed.trace()] == [2]
    assert 'data-turn="2"' in render_panel(replayed.trace())
    warnings = [r.getMessage() for r in caplog.records]
    assert any(str(rec.folder / TRANSCRIPT) in w and "skipped 2 line" in w for w in warnings)
    assert any(str(rec.folder / TRACE) in w and "skipped 3" in w for w in warnings)


# 8. One unreadable recording folder does not hide the others -----------------------------------------
def test_a_recording_folder_that_cannot_be_read_is_left_out_of_the_list(tmp_path, monkeypatch):
    mine = SessionRecorder(tmp_path, "mine", 24, (32, 32), {"preset": "ada"})
    mine.write_frame(np.zeros((32, 32, 3), np.uint8), np.zeros(667, np.float32))
    mine.close({})
    theirs = tmp_path / "20000101-000000-theirs"  # made by another user, mode 0700
    theirs.mkdir()
    is_file = Path.is_file

    def no_entry(self: Path) -> bool:
        if self.parent == theirs:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", no_entry)
    assert [r.folder for r in list_recordings(tmp_path)] == [mine.folder]
    assert find_recording(tmp_path, mine.folder.name).meta["preset"] == "ada"


# 11. Why the session ended is kept with its recording ------------------------------------------------
def test_why_a_session_ended_is_kept_in_its_session_json(tmp_path):
    live = _recorded_session(tmp_path)
    live.failure = "engine stopped: talkloop-diffusion-0 died"  # as the pump sets it
    live.stop(None)
    [rec] = list_recordings(tmp_path)
    assert rec.meta["failure"] == "engine stopped: talkloop-diffusion-0 died"
    live = _recorded_session(tmp_path / "ok")
    live.stop(None)
    [rec] = list_recordings(tmp_path / "ok")
    assert rec.meta["failure"] is None and rec.meta["ended"] > 0


def test_a_microphone_that_fails_to_close_does_not_keep_the_session_running(tmp_path):
    from app.config import build_config
    from app.controller import Controller

    config = build_config(None, {"spec": "tiny", "device": "cpu", "recordings_dir": str(tmp_path / "rec"),
                                 "session_log": str(tmp_path / "sessions.jsonl"), "asr_model": str(tmp_path / "no-model")})
    controller = Controller(config)
    try:
        live = controller.start("ada", record=True)

        class UnpluggedMic:
            def close(self) -> None:
                raise OSError("PortAudio: device unavailable")

        controller.local_mic = UnpluggedMic()
        controller.stop()
        assert live.closed.is_set() and live.stats is not None  # the session, its log and recording are closed
        assert controller.local_mic is None
        assert any("closing the local microphone failed: PortAudio: device unavailable" in f for f in controller.failures())
    finally:
        controller.close()


class _SlowVideo:
    """A video whose frames take a while to encode; notes whether it was closed while a frame was being written."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.in_write = False
        self.closed_during_write: bool | None = None

    def write(self, rgb, pcm) -> None:
        self.in_write = True
        self.writing.set()
        time.sleep(0.3)
        self.in_write = False

    def close(self) -> None:
        self.closed_during_write = self.in_write


def test_closing_a_recording_waits_for_the_frame_being_written(tmp_path):
    # stop() closes the recording once the pump's join times out: the pump may still be inside a frame's write
    rec = SessionRecorder(tmp_path, "race", 24, (32, 32), {})
    rec.video.close()
    rec.video = slow = _SlowVideo()
    pump = threading.Thread(target=rec.write_frame, args=(None, None))
    pump.start()
    assert slow.writing.wait(5)
    rec.close({"fps": 24.0})
    pump.join(5)
    assert slow.closed_during_write is False
    rec.write_frame(None, None)  # a frame after the close is dropped, not written into a closed file
    assert rec.video is None
