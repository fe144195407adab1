"""Session API: shapes, determinism, audio-feature timeline and bad input."""

import pytest
import torch

from engine.config import get_spec, shard_spec
from engine.session import EngineSession, noise_levels
from tests.helpers import TINY, reference_latent, run_session, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_step_shape_and_finite(model):
    out = run_session(model, 3)
    assert out.shape == (3, TINY.latent_channels, *TINY.latent_grid)
    assert torch.isfinite(out).all()


def test_deterministic_under_seed(model):
    a = run_session(model, 6, seed=11)
    b = run_session(model, 6, seed=11)
    c = run_session(model, 6, seed=12)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-2


def test_time_modulation_is_made_once_per_session_and_refreshed_when_its_weights_change(model, monkeypatch):
    """The per-pass time modulation depends on the noise schedule and the time weights only: a session makes it
    once (plus the reference's), its frames equal those of passes that make it afresh, and a time weight
    changed in place between steps reaches the next step."""
    from tests.helpers import tiny_model

    def stepper(m, **kwargs):
        session = EngineSession(m, seed=5, **kwargs)
        session.start(reference_latent(m.spec))
        g = torch.Generator().manual_seed(7)

        def step():
            session.push_audio_features(torch.randn(m.spec.frames_per_latent, m.spec.n_mels, generator=g))
            return session.step()
        return session, step

    fresh_model = tiny_model()  # the same weights as the fixture's
    calls = []
    made = model.time_modulation
    monkeypatch.setattr(model, "time_modulation", lambda level: calls.append(1) or made(level))
    session, step = stepper(model)
    fresh, fresh_step = stepper(fresh_model)
    fresh._refresh_modulations = lambda: setattr(fresh, "_time_mods", [None] * fresh_model.spec.passes)  # every pass makes its own
    for _ in range(3):
        assert torch.equal(step(), fresh_step())
    assert len(calls) == 1 + model.spec.passes  # the reference's, then one per pass of the schedule
    kept = model.time_proj[1].bias.detach().clone()
    with torch.no_grad():
        for m in (model, fresh_model):
            m.time_proj[1].bias.add_(0.5)
    assert torch.equal(step(), fresh_step())
    assert len(calls) == 1 + 2 * model.spec.passes
    with torch.no_grad():
        model.time_proj[1].bias.copy_(kept)  # the fixture is shared


def test_noise_levels_run_from_one_to_zero():
    levels = noise_levels(4)
    assert levels[0] == 1.0 and levels[-1] == 0.0 and len(levels) == 5
    assert all(a > b for a, b in zip(levels, levels[1:]))
    shifted = noise_levels(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and shifted[2] > levels[2]


def test_audio_features_condition_the_frames(model):
    quiet = EngineSession(model, seed=1)
    loud = EngineSession(model, seed=1)
    for s in (quiet, loud):
        s.start(reference_latent())
    loud.push_audio_features(torch.ones(4, TINY.n_mels))
    assert (quiet.step() - loud.step()).abs().max() > 1e-3


def test_feature_timeline_fills_gaps_with_silence_and_overwrites(model):
    s = EngineSession(model)
    s.start(reference_latent())
    s.push_audio_features(torch.ones(2, TINY.n_mels), start_frame=3)
    window = s._audio_window()  # frames -1 .. 4
    assert torch.equal(window[0], s._silence) and torch.equal(window[3], s._silence)
    assert torch.equal(window[4], torch.ones(TINY.n_mels))
    s.push_audio_features(torch.zeros(1, TINY.n_mels), start_frame=3)
    assert torch.equal(s._audio_window()[4], torch.zeros(TINY.n_mels))
    s.step()
    with pytest.raises(ValueError, match="too late"):
        s.push_audio_features(torch.zeros(1, TINY.n_mels), start_frame=0)


def test_audio_window_of_pushed_frames_is_the_frames_rows(model):
    """Where every frame of the window was pushed, the window is those rows of the timeline, step after step
    (also after frames before it were dropped), as where some are missing and silence stands in."""
    s = EngineSession(model)
    s.start(reference_latent())
    features = torch.arange(30 * TINY.n_mels, dtype=torch.float32).reshape(30, TINY.n_mels)
    s.push_audio_features(features, start_frame=-TINY.audio_context)  # frames -1 .. 28
    for _ in range(3):
        first = s.next_frame - TINY.audio_context
        rows = features[first + TINY.audio_context : first + TINY.audio_context + TINY.audio_window]
        assert torch.equal(s._audio_window(), rows.to(s._audio_window().dtype))
        s.step()
    # frames past the last one pushed are silence, as are the frames of a gap before the first
    fresh = EngineSession(model)
    fresh.start(reference_latent())
    fresh.push_audio_features(features[:3], start_frame=1)  # frames 1 .. 3 of the window -1 .. 4
    window = fresh._audio_window()
    assert all(torch.equal(window[r], fresh._silence) for r in (0, 1, 5))
    assert torch.equal(window[2:5], features[:3].to(window.dtype))


def test_a_window_handed_to_the_step_is_the_window_of_pushed_features(model):
    """A caller that keeps the speech (the realtime character) hands each step its window; the session keeps no
    copy, and the frames equal those of a session that was pushed the same rows."""
    g = torch.Generator().manual_seed(3)
    features = torch.randn(4 * 4 + TINY.audio_window, TINY.n_mels, generator=g)  # frames -1 on
    pushed, handed = EngineSession(model, seed=4), EngineSession(model, seed=4)
    for s in (pushed, handed):
        s.start(reference_latent())
    pushed.push_audio_features(features, start_frame=-TINY.audio_context)
    for _ in range(4):
        first = handed.next_frame  # row r of `features` is frame r - audio_context
        assert torch.equal(pushed.step(), handed.step(features[first:first + TINY.audio_window]))
    assert handed._features.shape[0] == 0
    with pytest.raises(ValueError, match="window must have shape"):
        handed.step(features[:2])
    with pytest.raises(ValueError, match="NaN"):
        handed.step(torch.full((TINY.audio_window, TINY.n_mels), float("nan")))


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(3, 4, 4), "shape"),
        (torch.zeros(4, 5, 4), "shape"),
        (torch.full((4, 4, 4), float("nan")), "NaN"),
        ([[0.0]], "shape"),
    ],
)
def test_start_rejects_bad_reference(model, bad, message):
    with pytest.raises(ValueError, match=message):
        EngineSession(model).start(bad)


def test_bad_session_use(model):
    s = EngineSession(model)
    with pytest.raises(ValueError, match="not started"):
        s.step()
    s.start(reference_latent())
    with pytest.raises(ValueError, match="already started"):
        s.start(reference_latent())
    with pytest.raises(ValueError, match="shape"):
        s.push_audio_features(torch.zeros(4, TINY.n_mels + 1))
    with pytest.raises(ValueError, match="NaN"):
        s.push_audio_features(torch.full((4, TINY.n_mels), float("inf")))
    with pytest.raises(ValueError, match="cache"):
        EngineSession(model, cache="paged")
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineSession(model, kv_dtype="int4")
    with pytest.raises(ValueError, match="reset_every"):
        EngineSession(model, reset_every=-1)
    with pytest.raises(ValueError, match="one at a time"):
        s.cache.begin_step(5)


def test_specs():
    with pytest.raises(ValueError, match="unknown spec"):
        get_spec("characters-3b")
    big = get_spec("characters-57b")
    assert big.frame_tokens == 757 and big.video_tokens == 748 and big.cache_slots == 5788
    assert big.n_blocks == 60 and big.passes == 4
    assert all(big.n_heads % tp == 0 for tp in (2, 3, 4))
    assert shard_spec(big, 3).n_heads == 20 and shard_spec(big, 3).head_dim == 128
    demo = get_spec("demo")
    assert demo.video_tokens == 256 and 8 <= demo.n_blocks <= 12
    with pytest.raises(ValueError, match="tensor-parallel"):
        shard_spec(big, 7)
    with pytest.raises(ValueError, match="sink_slots"):
        TINY.with_(sink_slots=3)
