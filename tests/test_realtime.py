"""The real-time character: audio and frames in sync, barge-in, the loop thread."""

import threading

import numpy as np
import pytest
import torch

from engine.audio import SAMPLE_RATE, frame_sample
from engine.codec import StandInCodec
from engine.playout import PlayoutBuffer
from engine.realtime import RealtimeCharacter
from engine.session import EngineSession
from tests.helpers import TINY, reference_latent, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_character(model, **kw) -> RealtimeCharacter:
    session = EngineSession(model, seed=2)
    session.start(reference_latent())
    return RealtimeCharacter(session, StandInCodec(TINY), **kw)


def first_frames(character: RealtimeCharacter, n: int) -> list:
    """The first n frames the running loop plays."""
    frames = []
    for frame in character.frames(timeout=10):
        frames.append(frame)
        if len(frames) == n:
            break
    return frames


def speech(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.2 * np.sin(2 * np.pi * 180 * t) + 0.01).astype(np.float32)


def test_frames_carry_exactly_the_audio_they_were_made_from(model):
    character = make_character(model)
    pcm = speech(0.5)  # 12 frames
    character.push_audio(pcm, SAMPLE_RATE)
    frames = [f for _ in range(4) for f in character.make_step()]
    assert [f.index for f in frames] == list(range(16))
    assert all(f.rgb.shape == (*TINY.image_size, 3) and f.rgb.dtype == np.uint8 for f in frames)
    assert [f.speaking for f in frames] == [True] * 12 + [False] * 4
    played = np.concatenate([f.pcm for f in frames])
    assert played.size == frame_sample(16)
    assert np.array_equal(played[: pcm.size], pcm) and not played[pcm.size:].any()


def test_speech_pushed_mid_session_starts_at_the_next_frame_to_make(model):
    character = make_character(model)
    character.make_step()
    character.push_audio(np.stack([speech(0.2)] * 2, axis=1), SAMPLE_RATE)  # stereo is mixed down
    frames = character.make_step()
    assert frames[0].index == 4 and frames[0].speaking


def test_barge_in_silences_waiting_frames_and_drops_unmade_speech(model):
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=16))
    character.push_audio(speech(2.0), SAMPLE_RATE)
    character.playout.put(character.make_step())
    character.clear()
    waiting = list(character.playout.frames)
    assert waiting and not any(f.speaking or f.pcm.any() for f in waiting)
    assert not any(f.speaking for f in character.make_step())


def test_pushed_speech_says_when_it_will_play(model):
    """push_audio returns when its first sample plays: the frames ahead of it are released one per 1/fps from the
    next release on (on the playout buffer's clock, here a fake one the test moves frame by frame)."""
    clock = [0.0]
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=32, clock=lambda: clock[0]))
    period = 1 / TINY.fps
    for _ in range(2):
        character.playout.put(character.make_step())  # frames 0-7 wait; playback starts at t=0
    clock[0] = 2 * period
    assert [f.index for f in character.playout.pop_due()] == [0, 1, 2]
    starts = character.push_audio(speech(0.5), SAMPLE_RATE)  # lands on frame 8, the next one not yet made
    assert starts == pytest.approx(8 * period)
    # speech pushed after it starts where it ends, mid-frame
    assert character.push_audio(speech(0.25), SAMPLE_RATE) == pytest.approx(8 * period + 0.5)
    released_at = None
    for k in range(3, 40):
        if len(character.playout.frames) < 8:
            character.playout.put(character.make_step())
        clock[0] = k * period
        if any(f.speaking for f in character.playout.pop_due()):
            released_at = clock[0]
            break
    assert released_at == pytest.approx(starts)


def test_barge_in_leaves_no_unheard_speech_in_the_next_steps_audio_context(model):
    """Frames made but not yet released are silenced by a barge-in; their speech leaves the audio timeline too,
    so the steps made next do not read it as context."""
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=16))
    character.push_audio(speech(2.0), SAMPLE_RATE)
    for _ in range(2):
        character.playout.put(character.make_step())
    character.clear()
    assert not any(character.timeline.frame_pcm(k).any() for k in range(8))


def test_barge_in_silences_a_step_on_its_way_into_the_buffer(model):
    """A barge-in after a step left the submitted queue and before the loop put its frames in the buffer (held
    there by the on_step hook) finds them in neither place; they are silenced on the way in all the same."""
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=16))
    in_transit, cleared = threading.Event(), threading.Event()

    def hold_first_step(step: int, seconds: float) -> None:
        if step == 0:
            in_transit.set()
            cleared.wait(10)

    character.on_step = hold_first_step
    character.push_audio(speech(2.0), SAMPLE_RATE)
    character.start()
    try:
        assert in_transit.wait(30)
        character.clear()
        cleared.set()
        frames = first_frames(character, 8)
    finally:
        character.stop()
    assert [f.index for f in frames] == list(range(8))
    assert not any(f.speaking or f.pcm.any() for f in frames)


def test_a_stop_that_outwaits_its_step_says_so(model, caplog):
    character = make_character(model)
    character.STOP_WAIT_S = 0.2
    in_step, release = threading.Event(), threading.Event()

    def slow_step(step: int) -> None:
        if step == 1:
            in_step.set()
            release.wait(10)

    character.before_step = slow_step
    character.start()
    assert in_step.wait(30)
    stats = character.stop()
    release.set()
    assert stats["loop_still_running_at_stop"] is True
    assert "still in a step" in caplog.text
    character._thread.join(10)
    assert not character._thread.is_alive()


def test_loop_thread_streams_frames_in_order_and_stops(model):
    character = make_character(model)
    character.start()
    frames = first_frames(character, 12)
    character.stop()
    assert [f.index for f in frames] == list(range(12))
    stats = character.stats()
    assert stats["steps"] >= 3 and stats["step_ms_p50"] > 0
    assert list(character.frames(timeout=0.2)) == []


def test_a_dying_engine_is_reported_not_hidden(model):
    class BrokenCodec(StandInCodec):
        def decode(self, latent):
            raise RuntimeError("decoder out of memory")

    session = EngineSession(model)
    session.start(reference_latent())
    character = RealtimeCharacter(session, BrokenCodec(TINY))
    character.start()
    with pytest.raises(RuntimeError, match="engine loop died"):
        next(character.frames(timeout=5))
    character.stop()


def test_character_needs_a_started_session(model):
    with pytest.raises(ValueError, match="reference"):
        RealtimeCharacter(EngineSession(model), StandInCodec(TINY)).start()


def test_session_log_reports_the_share_of_slow_sessions(tmp_path, model):
    from engine.session_log import record_session
    from lab.session_report import summarize

    log = tmp_path / "sessions.jsonl"
    character = make_character(model)
    character.start()
    first_frames(character, 31)
    stats = character.stop(session_log=str(log))
    assert stats["seconds"] > 1.0 and stats["fps"] > 0
    record_session({"seconds": 30.0, "fps": 23.1}, log)
    record_session({"seconds": 0.4, "fps": 5.0}, log)  # under a second: not counted
    with open(log, "a") as f:
        f.write("{broken\n")
    summary = summarize(log)
    assert summary["sessions"] == 3 and summary["counted"] == 2 and summary["unreadable_lines"] == 1
    behind = stats["fps"] < 24 * (1 - 1e-3)
    assert summary["share_below_24_fps"] == pytest.approx((behind + 1) / 2)
    # Sessions without an underrun average 24 fps give or take the clock's rounding: on time, either side.
    on_time = tmp_path / "on_time.jsonl"
    for fps in (24.000000001, 23.999999997, 23.9, 23.1):
        record_session({"seconds": 60.0, "fps": fps}, on_time)
    assert summarize(on_time)["share_below_24_fps"] == 0.5
    assert summarize(on_time)["median_fps"] == pytest.approx((23.999999997 + 23.9) / 2)  # an even count: the middle two
    with open(on_time, "ab") as f:
        f.write(b'{"seconds": 60.0, "fps": \xff}\n')  # not UTF-8: one more unreadable line, not an error
    assert summarize(on_time)["unreadable_lines"] == 1
    with pytest.raises(ValueError, match="is a folder"):
        summarize(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        summarize(tmp_path / "missing.jsonl")


def test_adaptive_lead_waits_for_a_full_window_then_follows_the_slowest_step(model):
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=7), adaptive_lead=True)
    window = character._lead_window.maxlen
    assert window >= TINY.reset_every + 6  # a reset step always falls inside it

    def step(seconds: float) -> None:  # what the loop does after each step's frames are in
        character.step_seconds.append(seconds)
        character._adapt_lead()

    for _ in range(character.ADAPT_AFTER):
        step(2.0)  # warm-up steps (graph capture): left out
    for _ in range(window - 1):
        step(0.006)
    assert character.playout.lead == 7  # the window is not full yet
    step(0.006)
    assert character.playout.lead == 2 and character.stats()["lead"] == 2
    step(0.263)  # a slow step: the lead grows at once
    assert character.playout.lead == 7
    for _ in range(window - 1):
        step(0.006)
    assert character.playout.lead == 7  # still in the window
    step(0.006)
    assert character.playout.lead == 2  # gone from it
    fixed = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=7))
    assert fixed.adaptive_lead is False and fixed.playout.lead == 7
    rare = EngineSession(model, seed=2, reset_every=100)  # the session's own reset interval sets the window
    rare.start(reference_latent())
    assert RealtimeCharacter(rare, StandInCodec(TINY), adaptive_lead=True)._lead_window.maxlen == 106


class SlowCodec(StandInCodec):
    """A decoder that takes `seconds` a step: the engine makes 4 frames in that time, far below 24 fps."""

    def __init__(self, spec, seconds: float):
        super().__init__(spec)
        self.seconds = seconds

    def decode(self, latent):
        import time
        time.sleep(self.seconds)
        return super().decode(latent)


def run_slow(model, hold: bool, lookahead: int, seconds: float = 4.0) -> tuple[list, dict, int, int]:
    """A session whose steps take 0.3 s (13 fps); speech pushed once playback runs. Returns the frames played
    for `seconds` from then, the stats, the frame the speech starts on and the underruns before it."""
    import time
    session = EngineSession(model, seed=2)
    session.start(reference_latent())
    character = RealtimeCharacter(session, SlowCodec(TINY, 0.3), playout=PlayoutBuffer(prebuffer=4, max_lead=7),
                                  lookahead=lookahead, hold_when_late=hold)
    character.start()
    frames = first_frames(character, 4)
    start = None
    deadline = time.monotonic() + seconds
    for frame in character.frames(timeout=5):
        if start is None:
            start, underruns = character.next_frame, character.playout.stats.underruns
            character.push_audio(speech(1.5), SAMPLE_RATE)
        frames.append(frame)
        if time.monotonic() > deadline:
            break
    stats = character.stop()
    return frames, stats, start, underruns


@pytest.mark.parametrize("lookahead", [0, 1])
def test_a_slow_engine_holds_the_picture_and_keeps_the_voice_on_the_clock(model, lookahead):
    frames, stats, start, underruns = run_slow(model, hold=True, lookahead=lookahead)
    assert [f.index for f in frames] == list(range(len(frames)))  # one frame for every 1/24 s of sound
    # The sound never waited: with a step in flight from the start (lookahead), the first step's wait is
    # unforeseeable (its time is not known yet); none after it.
    assert stats["underruns"] == underruns <= lookahead and stats["fps"] > 22.5, stats
    held = [f.held for f in frames]
    assert stats["frames_held"] >= sum(held) > len(frames) / 3  # 4 new pictures a 0.3 s step: ~13 of 24
    assert all(np.shares_memory(f.rgb, frames[i - 1].rgb) for i, f in enumerate(frames) if f.held)  # the picture before it
    assert 0 < stats["video_fps_recent"] < 18, stats
    # Every sample of the speech plays, in order, from the frame it was placed on: the held frames carry theirs.
    pcm = speech(1.5)
    played = np.concatenate([f.pcm for f in frames if f.index >= start])
    assert played.size >= pcm.size and np.array_equal(played[: pcm.size], pcm)


def test_without_holding_a_slow_engine_stalls_the_voice(model):
    frames, stats, _, _ = run_slow(model, hold=False, lookahead=0, seconds=1.5)
    assert stats["underruns"] > 0 and stats["frames_held"] == 0 and not any(f.held for f in frames)


def test_the_decoder_gets_its_frames_rows_of_the_step_window(model):
    """An audio-conditioned codec is handed the rows of the step's own 4 frames (audio_context 0 here), cut from
    the window the session denoised on: the log-mel features of those frames of the speech."""
    from engine.mel import log_mel_frames

    class RecordingCodec(StandInCodec):
        audio_mels, audio_context = TINY.n_mels, 0

        def __init__(self, spec):
            super().__init__(spec)
            self.rows: list[torch.Tensor] = []

        def decode(self, latent, audio=None, listen=None):
            self.rows.append(audio.clone())
            return super().decode(latent)

    session = EngineSession(model, seed=2)
    session.start(reference_latent())
    windows = []
    step = session.step
    session.step = lambda audio=None: (windows.append(audio.clone()), step(audio))[1]
    codec = RecordingCodec(TINY)
    character = RealtimeCharacter(session, codec)
    pcm = speech(0.4)
    character.push_audio(pcm, SAMPLE_RATE)
    for _ in range(4):
        character.make_step()
    ctx = TINY.audio_context
    assert len(codec.rows) == 4
    for t, (rows, window) in enumerate(zip(codec.rows, windows)):
        assert torch.equal(rows, window[ctx:ctx + 4])
        assert torch.allclose(rows, log_mel_frames(pcm, TINY.n_mels, 4 * t, 4), atol=1e-5)


def test_the_frames_a_step_would_bring_late_are_counted_on_the_playout_clock(model):
    """Playback starts at t=100 with frames 0-3 waiting, so frame 4 is due at 100 + 4/24. A step of 0.31 s (times
    the margin 1.25) would bring it at 100.3875: 5.3 frames late, so 6 frames and one to spare are held; a step of
    0.01 s brings it in time."""
    now = [100.0]
    character = make_character(model, playout=PlayoutBuffer(prebuffer=4, max_lead=7, clock=lambda: now[0]),
                               hold_when_late=True)
    character._put(character.make_step(), character._clears)
    character.step_seconds.clear()
    character.step_seconds.append(0.31)
    assert character._frames_late(4) == 7
    now[0] += 2 / 24 + 1e-6
    assert len(character.playout.pop_due()) == 3  # frames 0-2 played: frame 4 is still due at 100 + 4/24
    assert character._frames_late(4) == 9  # and a step begun now brings it 2 frames later
    character.step_seconds.extend([0.05] * (character.HOLD_WINDOW - 1))  # the slowest of the latest steps decides
    assert character._frames_late(4) == 9
    character.step_seconds.extend([0.04] * character.HOLD_WINDOW)
    assert character._frames_late(4) == 1  # in time by 0.02 s, less than the one frame to spare
    character.step_seconds.extend([0.01] * character.HOLD_WINDOW)
    assert character._frames_late(4) == 0


def test_each_steps_first_frame_is_blended_with_the_frame_made_before_it(model):
    """group_blend 0.5: a step's first frame lies halfway between the codec's drawing and the frame before it; the
    first step, and the other frames of every step, are the codec's own."""
    from engine.realtime import blend_group_start

    plain, blended = make_character(model), make_character(model, group_blend=0.5)
    a = [[f.rgb for f in plain.make_step()] for _ in range(3)]
    b = [[f.rgb for f in blended.make_step()] for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
    for step in (1, 2):
        assert np.array_equal(b[step][0], blend_group_start(a[step][0], a[step - 1][-1], 0.5))
        assert not np.array_equal(b[step][0], a[step][0])
        assert all(np.array_equal(x, y) for x, y in zip(a[step][1:], b[step][1:]))
    half = blend_group_start(np.full((1, 1, 3), 10, np.uint8), np.full((1, 1, 3), 21, np.uint8), 0.5)
    assert half.dtype == np.uint8 and int(half[0, 0, 0]) == 16  # 15.5 rounds to even
    with pytest.raises(ValueError, match=r"group_blend must be in \[0, 1\), got 1.0"):
        make_character(model, group_blend=1.0)
