"""Write paths under failure: a full disk, a log path that is a folder, a file an earlier run left mid-line."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from engine.audio import SAMPLE_RATE
from engine.codec import StandInCodec
from engine.media import Mp4Writer
from engine.realtime import RealtimeCharacter
from engine.session import EngineSession
from engine.session_log import record_session
from lab.session_report import summarize
from tests.helpers import TINY, reference_latent, tiny_model
from voice.trace import SessionTrace, read_jsonl


def open_descriptors_of(path: Path) -> int:
    """How many of this process's file descriptors point at `path`."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in os.listdir(fds):
        try:
            count += os.path.realpath(fds / fd) == str(path.resolve())
        except OSError:  # the descriptor listing the folder itself is gone by now
            continue
    return count


class _DiskFullOnMux:
    """The writer's real container, except that muxing a packet fails as a full disk does."""

    def __init__(self, container) -> None:
        self.container = container

    def mux(self, packet) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self.container.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors through /proc/self/fd")
def test_a_recording_whose_flush_hits_a_full_disk_still_lets_go_of_its_file(tmp_path):
    path = tmp_path / "session.mp4"
    writer = Mp4Writer(path, 24, (32, 32))
    for i in range(30):
        writer.write(np.full((32, 32, 3), 8 * i, np.uint8), np.full(SAMPLE_RATE // 24, 0.1, np.float32))
    assert open_descriptors_of(path) == 1
    writer.container = _DiskFullOnMux(writer.container)  # the encoders' tails meet a full disk
    with pytest.raises(OSError) as failure:
        writer.close()
    assert failure.value.errno == errno.ENOSPC  # the caller learns what went wrong
    assert open_descriptors_of(path) == 0  # and the file is let go: a deleted recording frees its blocks
    writer.close()  # a second close (a caller's cleanup path) is harmless


def test_a_session_record_after_a_line_cut_short_stays_readable(tmp_path):
    log = tmp_path / "sessions.jsonl"
    record_session({"seconds": 30.0, "fps": 24.0}, log)
    with open(log, "a") as f:
        f.write('{"ended": 1, "seconds": 12.0, "fp')  # an earlier run died (or the disk filled) mid-write
    record_session({"seconds": 60.0, "fps": 23.0}, log)
    summary = summarize(log)
    assert summary["sessions"] == 2 and summary["unreadable_lines"] == 1  # the fragment alone is lost
    assert summary["median_fps"] == pytest.approx(23.5)
    assert log.read_bytes().endswith(b"\n")


def test_a_session_record_in_a_whole_or_empty_log_adds_no_blank_line(tmp_path):
    log = tmp_path / "sessions.jsonl"
    log.write_bytes(b"")
    record_session({"seconds": 30.0, "fps": 24.0}, log)
    record_session({"seconds": 60.0, "fps": 24.0}, log)
    lines = log.read_text().split("\n")
    assert len(lines) == 3 and lines[2] == "" and all(json.loads(line)["fps"] == 24.0 for line in lines[:2])


def test_a_trace_appended_to_a_file_an_earlier_run_left_mid_line_stays_readable(tmp_path):
    path = tmp_path / "trace.jsonl"
    earlier = SessionTrace(path, session_id="earlier")
    earlier.write(earlier.new_turn())
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"session_id": "earlier", "turn_id": 2, "stam')  # that run died mid-write
    later = SessionTrace(path, session_id="later")  # a new process appends to the same file
    later.write(later.new_turn())
    later.write(later.new_turn())
    records = sorted((r["session_id"], r["turn_id"]) for r in read_jsonl(path))
    assert records == [("earlier", 1), ("later", 1), ("later", 2)]
    assert later.error is None and "\n\n" not in path.read_text()  # one line break added, once


@pytest.mark.parametrize("failure", ["log path is a folder", "disk full"])
def test_a_session_log_that_cannot_be_written_keeps_the_sessions_figures(tmp_path, monkeypatch, caplog, failure):
    log = tmp_path / "sessions.jsonl"
    if failure == "log path is a folder":
        log.mkdir()
    else:
        import engine.realtime

        def disk_full(stats: dict, path=None):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(engine.realtime, "record_session", disk_full)
    session = EngineSession(tiny_model(), seed=2)
    session.start(reference_latent())
    character = RealtimeCharacter(session, StandInCodec(TINY))
    character.make_step()
    character.make_step()
    with caplog.at_level(logging.ERROR, logger="engine.realtime"):
        stats = character.stop(session_log=str(log))
    assert stats["steps"] == 2 and "fps" in stats and stats["seconds"] == 0.0  # the figures survive
    assert str(log) in stats["session_log_error"]
    assert [r.getMessage() for r in caplog.records if r.name == "engine.realtime"] == [stats["session_log_error"]]


class _NoEncoders:
    """A real output container whose FFmpeg build has no encoder for the streams asked."""

    def __init__(self, container) -> None:
        self.container = container
        self.closed = False

    def add_stream(self, codec: str, **kwargs):
        raise ValueError(f"unknown encoder {codec!r}")

    def close(self) -> None:
        self.closed = True
        self.container.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors through /proc/self/fd")
def test_a_writer_that_cannot_add_its_streams_lets_go_of_its_file(tmp_path, monkeypatch):
    import engine.media

    opened: list[_NoEncoders] = []
    real_open = engine.media.av.open
    monkeypatch.setattr(engine.media.av, "open", lambda *a, **k: opened.append(_NoEncoders(real_open(*a, **k))) or opened[-1])
    path = tmp_path / "session.mp4"
    with pytest.raises(ValueError, match="unknown encoder 'libx264'"):
        Mp4Writer(path, 24, (32, 32))
    assert opened and opened[0].closed and open_descriptors_of(path) == 0


@pytest.mark.parametrize("size", [(33, 32), (32, 0), (32,), (32.0, 32)])
def test_a_video_size_h264_cannot_take_is_refused_before_any_file_is_made(tmp_path, size):
    path = tmp_path / "session.mp4"
    with pytest.raises(ValueError, match=r"video size .* must be \(height, width\), two positive even integers"):
        Mp4Writer(path, 24, size)
    assert not path.exists()


def test_a_frame_of_another_size_than_the_video_is_refused_not_scaled(tmp_path):
    with Mp4Writer(tmp_path / "session.mp4", 24, (32, 32)) as writer:
        writer.write(np.zeros((32, 32, 3), np.uint8), np.zeros(SAMPLE_RATE // 24, np.float32))
        with pytest.raises(ValueError, match=r"frame of shape \(30, 32, 3\) does not fit the video"):
            writer.write(np.zeros((30, 32, 3), np.uint8), np.zeros(SAMPLE_RATE // 24, np.float32))
        assert writer.frames == 1  # the refused frame took no timestamp


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_session_log_that_is_a_pipe_gets_its_records(tmp_path):
    fifo = tmp_path / "sessions.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reading end is open before anything is written
    try:
        record_session({"seconds": 30.0, "fps": 24.0}, fifo)  # a pipe cannot seek back to its last byte
        received = os.read(reader, 65536)
    finally:
        os.close(reader)
    assert json.loads(received.decode().splitlines()[0])["fps"] == 24.0
