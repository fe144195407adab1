"""Injected faults: each is reported, the session recovers or ends cleanly, and the recording and trace
written so far stay intact."""

import json

import av
import numpy as np
import pytest

from engine.audio import SAMPLE_RATE
from engine.codec import StandInCodec
from lab.faults import FAULT_KINDS, corrupt_audio, parse_fault
from engine.model import build_model
from engine.options import parse_options
from engine.realtime import RealtimeCharacter
from engine.session import EngineSession
from lab.soak import main, soak
from tests.helpers import TINY, reference_latent


def mp4_frames(path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def trace_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path).read().splitlines()]


def test_fault_specs_parse_and_bad_ones_are_named():
    f = parse_fault("slow-step@2.5:8")
    assert (f.kind, f.at, f.arg) == ("slow-step", 2.5, 8.0)
    assert parse_fault("exhaust-buffer@1").arg == 1.0 and parse_fault("kill-rank@3:1").arg == 1.0
    assert set(FAULT_KINDS) == {"kill-decoder", "kill-rank", "corrupt-audio", "exhaust-buffer", "slow-step"}
    for text, message in [("slow-step@x", "must be numbers"), ("slow-step@-1", ">= 0"), ("slow-step@1:0.5", "at least 1x"),
                          ("kill-rank@1:0.5", "whole number"), ("boom@1", "unknown fault")]:
        with pytest.raises(ValueError, match=message):
            parse_fault(text)


@pytest.fixture(scope="module")
def in_process_faults(tmp_path_factory):
    """One tiny real-time session with the three faults that need no engine processes, well apart."""
    d = tmp_path_factory.mktemp("faults")
    mp4, trace = d / "f.mp4", d / "f.jsonl"
    faults = [parse_fault("slow-step@1.5:10"), parse_fault("exhaust-buffer@3:1.0"), parse_fault("corrupt-audio@5.5")]
    report = soak(TINY, parse_options("fp8-cache"), seconds=7.5, speech_s=2.0, silence_s=1.0, record=str(mp4),
                  trace_path=str(trace), faults=faults, source="synth")
    return report, {f["kind"]: f for f in report["faults"]}, mp4, trace


def test_a_slow_step_is_reported_and_the_session_goes_on(in_process_faults):
    report, faults, _, _ = in_process_faults
    slow = faults["slow-step"]
    assert slow["injected_at_s"] is not None and slow["added_ms"] == pytest.approx(9 * slow["median_step_ms"])
    assert report["step_ms"]["max"] >= slow["added_ms"]  # the slow step shows in the step times
    assert slow["outcome"] in ("absorbed by the playout buffer", "underrun reported; recovered")
    assert report["ended"] == "ran its time"


def test_an_exhausted_playout_buffer_is_counted_and_recovers(in_process_faults):
    report, faults, _, _ = in_process_faults
    stall = faults["exhaust-buffer"]
    # A 1 s stall outlasts the buffer's lead (at most 8 frames, 333 ms): at least one underrun, then frames again.
    assert stall["underruns_after"] >= 1 and stall["frames_after"] > 0
    assert stall["outcome"] == "underrun reported; recovered"
    assert report["underruns"] >= 1 and report["seconds_below_24fps"] >= 1


def test_corrupt_audio_is_refused_and_never_played(in_process_faults):
    report, faults, mp4, trace = in_process_faults
    bad = faults["corrupt-audio"]
    assert "NaN" in bad["refused"] and bad["outcome"] == "refused; session went on" and bad["frames_after"] > 0
    with av.open(str(mp4)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert np.isfinite(audio).all()
    assert report["frames_recorded"] == mp4_frames(mp4)
    events = trace_lines(trace)
    assert [e["kind"] for e in events if e["event"] == "fault"] == ["slow-step", "exhaust-buffer", "corrupt-audio"]
    assert events[-1]["event"] == "end" and events[-1]["ended"] == "ran its time"


def test_a_killed_diffusion_rank_ends_the_session_cleanly(tmp_path, capsys):
    mp4, trace = tmp_path / "k.mp4", tmp_path / "k.jsonl"
    code = main(["--spec", "tiny", "--config", "fp8-cache,tp=2", "--seconds", "30", "--speech", "2", "--silence", "1",
                 "--audio-source", "synth", "--record", str(mp4), "--trace", str(trace), "--fault", "kill-rank@2.5:1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ended"] == "engine failure" and report["restarts"] == 0
    assert "talkloop-diffusion-1 died" in report["error"]
    fault = report["faults"][0]
    assert fault["process"] == "talkloop-diffusion-1" and fault["outcome"] == "reported; session ended cleanly"
    assert report["wall_seconds"] < 30  # it ended on the failure, not at its time
    assert report["frames_recorded"] == mp4_frames(mp4) > 0  # everything played before the failure is in the file
    events = trace_lines(trace)
    assert [e["event"] for e in events if e["event"] in ("fault", "error", "restart")] == ["fault", "error"]
    assert events[-1]["event"] == "end" and "talkloop-diffusion-1" in events[-1]["error"]


def test_a_killed_decoder_is_replaced_by_a_new_engine_and_the_session_goes_on(tmp_path, capsys):
    mp4, trace = tmp_path / "k.mp4", tmp_path / "k.jsonl"
    code = main(["--spec", "tiny", "--config", "fp8-cache,processes=true", "--seconds", "12", "--speech", "2",
                 "--silence", "1", "--audio-source", "synth", "--record", str(mp4), "--trace", str(trace),
                 "--fault", "kill-decoder@2.5", "--restarts", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["ended"] == "ran its time" and report["restarts"] == 1
    failure = report["failures"][0]
    assert "talkloop-decoder-0 died" in failure["error"] and failure["at_s"] < failure["restarted_at_s"] <= failure["frames_again_at_s"]
    fault = report["faults"][0]
    assert fault["outcome"] == "reported; engine restarted; session went on" and fault["frames_again_after_s"] > 0
    assert report["seconds_below_24fps"] >= 1  # the restart's gap is counted, not hidden
    assert report["frames_recorded"] == mp4_frames(mp4) == report["frames_released"]
    events = [e["event"] for e in trace_lines(trace)]
    assert events.index("fault") < events.index("error") < events.index("restart") and events[-1] == "end"
    assert "second" in events[events.index("restart"):]  # the session was watched after the restart too


def test_speech_pushed_while_a_step_is_in_flight_starts_after_it():
    """A turn's audio arriving mid-step must not land in (or break) the step already submitted."""
    spec = TINY
    session = EngineSession(build_model(spec, seed=0), seed=0)
    session.start(reference_latent(spec))
    character = RealtimeCharacter(session, StandInCodec(spec, seed=0))
    speech = (0.3 * np.sin(2 * np.pi * 200 * np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE)).astype(np.float32)
    for _ in range(3):
        character.make_step()
    character.before_step = lambda step: character.push_audio(speech, SAMPLE_RATE) if step == 3 else None
    frames = [f for _ in range(4) for f in character.make_step()]
    assert [f.index for f in frames] == list(range(12, 28))
    assert not any(f.speaking for f in frames[:4])  # the step in flight stays silent
    assert all(f.speaking for f in frames[4:16])  # the speech starts at the next step's first frame
    with pytest.raises(ValueError, match="NaN"):
        character.push_audio(corrupt_audio(), SAMPLE_RATE)


def test_a_message_lost_with_a_dying_process_names_the_process():
    """A decoder killed while its frames are being unpickled resets the connection: the engine names the dead process."""
    import multiprocessing
    import os

    from engine.distributed import DistributedEngine

    class ResetQueue:
        def get(self, timeout=None):
            raise ConnectionResetError(104, "Connection reset by peer")

    dead = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,), name="talkloop-decoder-0")
    dead.start()
    dead.join()
    engine = DistributedEngine.__new__(DistributedEngine)
    engine._outbox, engine._procs, engine._ranks, engine._decoders = ResetQueue(), [dead], [], [dead]
    engine._latents, engine._commands, engine.closed = [], [], False
    with pytest.raises(RuntimeError, match="talkloop-decoder-0 died \\(exit code 3\\)"):
        engine._get(timeout=5)
    assert engine.closed


def test_a_slow_step_waits_for_a_timed_step_to_be_a_multiple_of():
    """A slow step is a multiple of the median step: armed before any step was timed (at 0 s, or just after a
    restart) it waits for one, instead of adding nothing and being reported as absorbed."""
    from collections import deque

    from lab.faults import StepFaults

    times: deque[float] = deque()
    faults = StepFaults(times)
    slow = parse_fault("slow-step@0:2")
    faults.arm(slow)
    faults(0)
    assert slow.injected_at is None
    times.append(0.01)
    faults(1)
    assert slow.injected_at is not None and slow.details["added_ms"] == pytest.approx(10.0)
