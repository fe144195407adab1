"""The procedural character: determinism, idle motion, and a mouth that follows the audio."""

import numpy as np
import pytest
import torch

from engine import character as ch
from engine.audio import SAMPLE_RATE

SIZE = (64, 64)


def tone(seconds: float, hz: float, amp: float) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def bursts(seed: int = 0) -> np.ndarray:
    """2 s of tone bursts and gaps at random times."""
    rng = np.random.default_rng(seed)
    x = np.zeros(2 * SAMPLE_RATE, np.float32)
    for _ in range(4):
        a = int(rng.integers(0, x.size - 4000))
        x[a:a + 4000] = tone(0.25, float(rng.uniform(150, 400)), 0.5)
    return x


def test_render_is_deterministic_for_a_seed():
    pcm = bursts()
    a, sa = ch.render_audio(pcm, "ada", seed=4, size=SIZE)
    b, sb = ch.render_audio(pcm, "ada", seed=4, size=SIZE)
    c, _ = ch.render_audio(pcm, "ada", seed=5, size=SIZE)
    assert a.shape == (48, 64, 64, 3) and a.dtype == torch.uint8
    assert sa.shape == (48, ch.STATE_SIZE)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    assert not torch.equal(a, c)  # another seed sways and blinks differently


def test_different_audio_moves_the_mouth():
    _, sa = ch.render_audio(bursts(0), "kofi", seed=1, size=SIZE)
    _, sb = ch.render_audio(bursts(1), "kofi", seed=1, size=SIZE)
    idle = slice(0, ch.S["open"])
    assert torch.equal(sa[:, idle], sb[:, idle])  # same idle motion
    assert (sa[:, ch.S["open"]] - sb[:, ch.S["open"]]).abs().max() > 0.5


def test_mouth_follows_loudness():
    silence = np.zeros(SAMPLE_RATE // 2, np.float32)
    pcm = np.concatenate([silence, tone(0.5, 220, 0.02), silence, tone(0.5, 220, 0.1), silence, tone(0.5, 220, 0.6), silence])
    mouth = ch.mouth_from_audio(pcm)
    opening = mouth[:, 0]
    centre = lambda k: opening[12 * (2 * k + 1) + 6]  # noqa: E731 - middle frame of the k-th tone
    assert opening[:8].max() == 0.0 and opening[-8:].max() == 0.0  # silence closes it
    assert 0.0 < centre(0) < centre(1) < centre(2)
    assert centre(2) > 0.8


def test_spectral_cue_rounds_vowels_and_widens_hiss():
    rng = np.random.default_rng(0)
    hiss = np.diff(rng.standard_normal(SAMPLE_RATE + 1)).astype(np.float32) * 0.3
    low = ch.mouth_from_audio(tone(1.0, 300, 0.5))[6:-6, 1]
    high = ch.mouth_from_audio(hiss)[6:-6, 1]
    assert low.min() > 0.6 and high.max() < 0.4


def test_idle_motion_is_a_function_of_the_frame():
    whole = ch.idle_motion(400, seed=9)
    part = ch.idle_motion(100, seed=9, first_frame=250)
    assert torch.allclose(whole[250:350], part, atol=1e-6)
    assert whole[:, 3].max() == 1.0  # it blinks within 16 s
    assert whole[:, 0].abs().max() < 0.05  # and sways only a little


def test_presets_and_reference():
    assert len(ch.PRESETS) >= 3
    pics = [ch.reference_image(name, SIZE) for name in ch.PRESETS]
    assert all(p.shape == (64, 64, 3) and p.dtype == torch.uint8 for p in pics)
    assert all(not torch.equal(pics[0], p) for p in pics[1:])
    assert ch.random_look(1) == ch.random_look(1) and ch.random_look(1) != ch.random_look(2)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown preset 'nobody'"):
        ch.render_audio(bursts(), "nobody", size=SIZE)
    with pytest.raises(ValueError, match="NaN"):
        ch.render_audio(np.full(1000, np.nan, np.float32), "ada", size=SIZE)
    with pytest.raises(ValueError, match="states must be"):
        ch.render(ch.look_vectors("ada"), torch.zeros(2, 3), SIZE)
    with pytest.raises(ValueError, match="mouth features"):
        ch.mouth_from_features(torch.zeros(5, 16))
