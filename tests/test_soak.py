"""Soak runs on the tiny spec: a real-time session with scripted turns, its report, recording and trace."""

import json
import os
import signal
import subprocess
import sys
import time

import av
import pytest

from engine.config import get_spec
from engine.options import parse_options
from lab.soak import growth_verdict, main, slope_per_minute, soak

TINY = get_spec("tiny")


def mp4_frames(path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def trace_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_short_soak_reports_and_records_everything(tmp_path):
    mp4, trace = tmp_path / "soak.mp4", tmp_path / "soak.jsonl"
    r = soak(TINY, parse_options("fp8-cache"), seconds=6.0, speech_s=2.0, silence_s=1.0, record=str(mp4),
             trace_path=str(trace), source="synth")
    assert r["ended"] == "ran its time" and r["error"] is None and r["audio_source"] == "synth"
    assert r["frames_recorded"] == r["frames_released"] == mp4_frames(mp4) > 0
    assert r["steps"] > 0 and 0 < r["step_ms"]["p50"] <= r["step_ms"]["p95"] <= r["step_ms"]["max"]
    assert 0 <= r["seconds_below_24fps"] <= r["whole_seconds"] and r["whole_seconds"] >= 3
    assert len(r["samples"]) >= 4 and all(s["host_mb"] > 0 for s in r["samples"])
    assert r["memory"]["host_mb_per_minute"] is not None and r["memory"]["gpu_mb_first"] is None
    assert r["memory"]["host_growth"] == "too short to tell"  # 6 s: a slope over seconds is start-up, not a trend
    events = trace_lines(trace)
    assert events[0]["event"] == "start" and events[0]["audio_source"] == "synth" and events[-1]["event"] == "end"
    assert [e["turn"] for e in events if e["event"] == "turn"] == [0, 1]  # turns at 0 s and 3 s
    assert sum(e["event"] == "second" for e in events) == len(r["samples"])


def test_a_recording_named_without_mp4_is_an_mp4_all_the_same(tmp_path):
    import numpy as np

    from engine.audio import SAMPLE_RATE
    from engine.media import Mp4Writer

    path = tmp_path / "clip"  # no extension to tell the container by
    writer = Mp4Writer(path, 24, (32, 32))
    for i in range(30):
        writer.write(np.full((32, 32, 3), 8 * i, np.uint8), np.zeros(SAMPLE_RATE // 24, np.float32))
    writer.close()
    assert mp4_frames(path) == 30


def test_slope_is_per_minute_and_ignores_missing():
    t = [0.0, 30.0, 60.0, 90.0]
    assert slope_per_minute(t, [100.0, 101.0, 102.0, 103.0]) == pytest.approx(2.0)
    assert slope_per_minute(t, [100.0, None, 100.0, 100.0]) == pytest.approx(0.0)
    assert slope_per_minute(t[:2], [1.0, 2.0]) is None
    assert growth_verdict(0.3) == "no growth" and growth_verdict(2.5).startswith("grows 2.50 MB per minute")
    assert growth_verdict(None) == "too short to tell"
    assert growth_verdict(40.0, span_s=16.0) == "too short to tell" and growth_verdict(40.0, span_s=90.0).startswith("grows")


@pytest.mark.parametrize("args, message", [
    (["--fault", "melt@3"], "unknown fault 'melt'"),
    (["--fault", "slow-step"], "needs a time"),
    (["--fault", "kill-decoder@2"], "kill faults need the engine's own processes"),
    (["--config", "fp8-cachee"], "unknown config preset"),
    (["--seconds", "0"], "--seconds must be positive"),
    (["--record", "/nonexistent-folder/x.mp4"], "folder /nonexistent-folder does not exist"),
    (["--record", "/tmp"], "'/tmp': it is a folder"),
    (["--trace", "/tmp"], "'/tmp': it is a folder"),
    (["--config", "fp8-cache,tp=2", "--fault", "kill-rank@1:5"], "there is no rank 5 (ranks 0..1)"),
])
def test_soak_cli_refuses_bad_arguments(args, message, capsys):
    assert main(["--spec", "tiny", "--seconds", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_ctrl_c_ends_the_soak_with_its_report_and_the_traces_end(tmp_path):
    import signal
    import subprocess
    import sys

    mp4, trace = tmp_path / "soak.mp4", tmp_path / "soak.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "lab.soak", "--spec", "tiny", "--seconds", "60", "--audio-source", "synth",
                             "--record", str(mp4), "--trace", str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C as in a terminal, also where pytest itself runs in the background (SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (trace.exists() and '"second"' in trace.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    report = json.loads(out)
    assert report["ended"] == "interrupted" and report["frames_recorded"] == mp4_frames(mp4) > 0
    assert trace_lines(trace)[-1]["event"] == "end" and "Traceback" not in err


def test_recording_and_trace_survive_a_killed_process(tmp_path):
    """SIGKILL the soak itself: the fragmented MP4 plays up to its last fragment, every trace line is whole."""
    mp4, trace = tmp_path / "crash.mp4", tmp_path / "crash.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lab.soak", "--spec", "tiny", "--seconds", "60", "--audio-source",
                             "synth", "--record", str(mp4), "--trace", str(trace)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if trace.exists() and sum('"second"' in line for line in trace.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the soak wrote no seconds to its trace")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    events = trace_lines(trace)  # raises if a line was cut
    assert events[0]["event"] == "start" and all(e["event"] != "end" for e in events)
    released = max(e["released"] for e in events if e["event"] == "second")
    assert mp4_frames(mp4) >= min(released, 48) - 24  # all but the fragment being written (1 s)


def test_a_stall_that_lasts_to_the_end_counts_in_the_seconds_below_24_fps(tmp_path):
    """The engine stalls from 2 s to past the end: those seconds had no frames and count, at 0 (they used to stop
    at the last frame played, so the run read as all on time)."""
    from lab.faults import parse_fault

    r = soak(TINY, parse_options("fp8-cache"), seconds=6.0, speech_s=2.0, silence_s=1.0, source="synth",
             faults=[parse_fault("exhaust-buffer@2:6")])
    assert r["ended"] == "ran its time"
    assert r["whole_seconds"] >= 4 and r["seconds_below_24fps"] >= 3, r


def test_a_trace_that_cannot_be_written_costs_the_trace_not_the_soak():
    r = soak(TINY, parse_options("fp8-cache"), seconds=2.0, speech_s=1.0, silence_s=1.0, trace_path="/dev/full",
             source="synth")
    assert r["ended"] == "ran its time" and r["frames_released"] > 0
    assert "No space left on device" in r["trace_error"]


def test_a_recording_that_fails_ends_the_session_with_its_report_and_trace(tmp_path, monkeypatch):
    from engine.media import Mp4Writer

    written = []
    real_write = Mp4Writer.write

    def write_until_the_disk_is_full(self, rgb, pcm):
        if len(written) == 30:
            raise OSError(28, "No space left on device")
        written.append(1)
        real_write(self, rgb, pcm)

    monkeypatch.setattr(Mp4Writer, "write", write_until_the_disk_is_full)
    mp4, trace = tmp_path / "soak.mp4", tmp_path / "soak.jsonl"
    r = soak(TINY, parse_options("fp8-cache"), seconds=8.0, speech_s=2.0, silence_s=1.0, record=str(mp4),
             trace_path=str(trace), source="synth")
    assert r["ended"] == "recording failed" and "No space left on device" in r["error"]
    assert mp4_frames(mp4) == 30  # the fragments written before stay playable
    events = trace_lines(trace)
    assert events[-1]["event"] == "end" and events[-1]["ended"] == "recording failed"


def test_an_engine_that_cannot_start_exits_1_not_as_bad_arguments(monkeypatch, capsys):
    import lab.soak

    def fail(*args, **kwargs):
        raise RuntimeError("diffusion rank 0 failed: CUDA out of memory")

    monkeypatch.setattr(lab.soak, "soak", fail)
    assert main(["--spec", "tiny", "--seconds", "1"]) == 1
    assert "CUDA out of memory" in capsys.readouterr().err


def test_fault_outcomes_say_what_happened():
    from lab.faults import parse_fault
    from lab.soak import _outcome

    samples = [{"t": float(t), "underruns": 0, "released": 24 * t} for t in range(12)]
    corrupt = parse_fault("corrupt-audio@5")
    corrupt.injected_at, corrupt.details["refused"] = 5.0, "audio contains NaN or infinite samples"
    _outcome(corrupt, samples, "engine failure", float("inf"), [])  # a later, unrelated failure ended the session
    assert corrupt.details["outcome"] == "refused; session went on"
    kill = parse_fault("kill-decoder@10")
    kill.injected_at = 10.0
    _outcome(kill, samples, "ran its time", float("inf"), [{"at_s": 10.5, "error": "x", "restarted_at_s": 11.9}])
    assert kill.details["outcome"] == "reported; engine restarted; no frames from it before the session's end"
