import numpy as np
import pytest

from engine.audio import SAMPLE_RATE
from voice.samples import sample_speech, speech_bounds, with_silence
from voice.vad import StreamingVAD, VADConfig, speech_segments

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def hello() -> np.ndarray:
    speech = sample_speech("Hello there, how are you today?")
    start, end = speech_bounds(speech)
    return speech[start:end]  # the synthesizer's own leading/trailing silence removed


def events_of(audio: np.ndarray, chunk: int, config: VADConfig | None = None):
    vad = StreamingVAD(config)
    events = []
    for offset in range(0, audio.size, chunk):
        events.extend(vad.process(audio[offset : offset + chunk]))
    return events


def test_segment_bounds_match_the_speech_with_pre_roll(hello):
    audio = with_silence(hello, before_s=1.0, after_s=1.5)
    true_start, true_end = speech_bounds(audio)
    segments = speech_segments(audio)
    assert len(segments) == 1
    start, end = segments[0]
    # The pre-roll reaches before the first sound, so the first word is never cut...
    assert true_start - 0.35 * SR <= start <= true_start - 0.05 * SR
    # ...and the segment closes shortly after the last sound (speech_pad_ms = 200).
    assert true_end <= end <= true_end + 0.4 * SR


@pytest.mark.parametrize("chunk", [160, 512, 1000, 8000])
def test_events_do_not_depend_on_chunk_size(hello, chunk):
    audio = with_silence(hello, before_s=0.7, after_s=1.0)
    assert events_of(audio, chunk) == events_of(audio, 512)


def test_turn_ends_after_min_silence(hello):
    audio = with_silence(hello, before_s=0.5, after_s=1.5)
    for min_silence_ms in (200, 600):
        events = events_of(audio, 512, VADConfig(min_silence_ms=min_silence_ms))
        end = next(e for e in events if e.kind == "end")
        pause = [e for e in events if e.kind == "pause"][-1]
        assert end.reason == "silence"
        # The segment's end is the start of the final silence plus the pad.
        assert end.end == pause.end + 200 * SR // 1000
        assert end.last_voiced <= pause.end


def test_short_pause_keeps_one_turn_long_pause_splits(hello):
    short_gap = np.concatenate([hello, np.zeros(int(0.15 * SR), np.float32), hello])
    long_gap = np.concatenate([hello, np.zeros(int(1.0 * SR), np.float32), hello])
    assert len(speech_segments(with_silence(short_gap))) == 1
    two = speech_segments(with_silence(long_gap))
    assert len(two) == 2 and two[0][1] <= two[1][0]


def test_silence_noise_and_tones_are_not_speech():
    rng = np.random.default_rng(0)
    t = np.arange(3 * SR) / SR
    assert speech_segments(np.zeros(3 * SR, np.float32)) == []
    assert speech_segments((0.03 * rng.standard_normal(3 * SR)).astype(np.float32)) == []
    assert speech_segments((0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)) == []


def test_long_speech_is_cut_at_max_speech_s(hello):
    gap = np.zeros(int(0.1 * SR), np.float32)
    monologue = with_silence(np.concatenate([hello, gap] * 4))
    events = events_of(monologue, 512, VADConfig(max_speech_s=2.0))
    ends = [e for e in events if e.kind == "end"]
    assert any(e.reason == "max_speech_s" for e in ends)
    starts = [e for e in events if e.kind == "start"]
    for start, end in zip(starts, ends):
        assert end.end - start.start <= (2.0 + 0.2 + 0.1) * SR


@pytest.mark.parametrize("settings, message", [
    ({"threshold": 50}, "threshold must be between 0 and 1, got 50"),  # a percentage typed by mistake
    ({"threshold": 0.0}, "threshold must be between 0 and 1"),
    ({"neg_threshold": 1.5}, "neg_threshold must be between 0 and 1"),
    ({"min_silence_ms": -1}, "min_silence_ms must be >= 0"),
    ({"speech_pad_ms": -200}, "speech_pad_ms must be >= 0"),
    ({"max_speech_s": 0}, "max_speech_s must be > 0"),
])
def test_settings_that_could_never_work_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        VADConfig(**settings)
