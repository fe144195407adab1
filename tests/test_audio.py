"""Audio front end: frame alignment, the timeline, conversions and bad input."""

import numpy as np
import pytest
import torch

from engine.audio import SAMPLE_RATE, frame_sample, resample, to_mono_16k
from engine.mel import log_mel_frames, silence_features
from engine.realtime import AudioTimeline


def tone(seconds: float, hz: float = 220.0, rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_one_vector_per_video_frame():
    feats = log_mel_frames(tone(1.0), n_mels=32)
    assert feats.shape == (24, 32)
    assert torch.isfinite(feats).all()
    assert frame_sample(24) == SAMPLE_RATE


def test_silence_features_match_zeros():
    feats = log_mel_frames(np.zeros(SAMPLE_RATE, np.float32), n_mels=16)
    assert torch.allclose(feats, silence_features(16).expand_as(feats))


def test_loudness_and_pitch_show_in_features():
    quiet, loud = log_mel_frames(0.01 * tone(0.5), 32), log_mel_frames(tone(0.5), 32)
    assert loud[6].max() > quiet[6].max() + 0.9  # 40 dB louder is +1.0 on this log scale
    low, high = log_mel_frames(tone(0.5, 200), 32), log_mel_frames(tone(0.5, 2000), 32)
    assert low[6].argmax() < high[6].argmax()


def test_timeline_features_equal_offline_features():
    speech = tone(1.3)
    timeline = AudioTimeline(fps=24)
    first = timeline.push(speech, not_before_frame=5)
    assert first == 5
    offline = log_mel_frames(np.concatenate([np.zeros(frame_sample(5), np.float32), speech]), 32)
    window = timeline.features(10, 8, 32)
    assert torch.allclose(window, offline[10:18], atol=1e-5)
    timeline.drop_before(9)
    assert torch.allclose(timeline.features(10, 8, 32), offline[10:18], atol=1e-5)
    pcm = np.concatenate([timeline.frame_pcm(f) for f in range(9, 20)])
    assert np.array_equal(pcm, np.concatenate([np.zeros(frame_sample(5), np.float32), speech])[frame_sample(9):frame_sample(20)])


def test_timeline_clear_silences_the_rest():
    timeline = AudioTimeline(fps=24)
    timeline.push(tone(1.0), 0)
    timeline.clear_from(6)
    assert np.abs(timeline.frame_pcm(5)).max() > 0
    assert np.abs(timeline.frame_pcm(6)).max() == 0 and np.abs(timeline.frame_pcm(30)).max() == 0
    assert timeline.push(tone(0.1), 8) == 8  # new speech starts where asked, not after the cleared one


def test_conversions():
    stereo48 = np.stack([tone(1.0, rate=48_000), tone(1.0, rate=48_000)], axis=1)
    mono = to_mono_16k(stereo48, 48_000)
    assert mono.shape == (SAMPLE_RATE,) and mono.dtype == np.float32
    ref = tone(1.0)
    assert np.abs(mono[100:-100] - ref[100:-100]).max() < 0.02
    as_int16 = to_mono_16k((ref * 32767).astype(np.int16), SAMPLE_RATE)
    assert np.abs(as_int16 - ref).max() < 1e-3
    assert resample(tone(1.0, rate=22_050), 22_050, 16_000).shape == (16_000,)
    # int16 stereo is scaled like int16 mono (mixing the channels first left it in the thousands)
    stereo_int16 = np.stack([(ref * 32767).astype(np.int16)] * 2, axis=1)
    assert np.abs(to_mono_16k(stereo_int16, SAMPLE_RATE) - ref).max() < 1e-3
    # chunks shorter than the low-pass filter keep their length's ratio (48 kHz -> 16 kHz: a third)
    for n in (3, 30, 63, 64, 65, 300):
        assert resample(np.ones(n, np.float32), 48_000, 16_000).size == round(n / 3)
    long = tone(1.0, rate=48_000)  # and the longer ones are filtered as before ("same" convolution)
    assert np.abs(resample(long, 48_000, 16_000)[100:-100] - ref[100:-100]).max() < 0.02


@pytest.mark.parametrize(
    "pcm, rate, message",
    [
        (np.zeros(1600, np.float32), 44_100, "16000 Hz"),
        (np.zeros((1600, 2), np.float32), SAMPLE_RATE, "mono"),
        (np.full(1600, np.nan, np.float32), SAMPLE_RATE, "NaN"),
        (np.zeros(1600, np.int32), SAMPLE_RATE, "float or int16"),
    ],
)
def test_front_end_rejects_bad_audio(pcm, rate, message):
    with pytest.raises(ValueError, match=message):
        log_mel_frames(pcm, 32, sample_rate=rate)


def test_conversion_rejects_bad_audio():
    with pytest.raises(ValueError, match="NaN"):
        to_mono_16k(np.array([0.0, np.inf], np.float32), 16_000)
    with pytest.raises(ValueError, match="shape"):
        to_mono_16k(np.zeros((2, 2, 2), np.float32), 16_000)
    with pytest.raises(ValueError, match="sample rate"):
        to_mono_16k(np.zeros(10, np.float32), 0)
    with pytest.raises(ValueError, match="float or int16, got int32"):
        to_mono_16k(np.zeros((10, 2), np.int32), 16_000)
