"""The ring cache against the plain reference path, FP8 bounds, resets and long sessions."""

import pytest
import torch

from engine import fp8
from engine.cache import RingKVCache
from engine.rope import apply_rope, cos_sin, temporal_delta_angles
from tests.helpers import TINY, rms_heads, run_session, tiny_model

# tiny: window of 3 frames, position reset every 5 steps; 14 steps = 4 windows and 2 resets.
STEPS = 14


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    return run_session(model, STEPS, cache="reference")


def test_ring_fp32_with_write_time_rope_matches_reference_across_resets(model, reference):
    assert STEPS > 4 * TINY.window_frames and STEPS // TINY.reset_every >= 2
    ring = run_session(model, STEPS, cache="ring", kv_dtype="fp32")
    assert (ring - reference).abs().max().item() <= 1e-5


def test_history_changes_the_output(model, reference):
    # Guards the comparisons above from being vacuous: the cache must matter.
    other = run_session(model, STEPS, cache="reference", audio_seed=8)
    assert (other[-1] - reference[-1]).abs().max().item() > 1e-2


def test_reset_invariance(model):
    with_resets = run_session(model, STEPS, cache="ring", kv_dtype="fp32", reset_every=5)
    without = run_session(model, STEPS, cache="ring", kv_dtype="fp32", reset_every=0)
    assert (with_resets - without).abs().max().item() <= 1e-4


def test_fp8_cache_error_is_bounded(model, reference):
    ring = run_session(model, STEPS, cache="ring", kv_dtype="fp8")
    rel = ((ring - reference).norm() / reference.norm()).item()
    # Measured 6.1e-4 .. 6.6e-4 over three seeds; bound with headroom, and it must not be exact.
    assert 0 < rel <= 2e-3


def test_fp8_delta_rotation_agrees_with_requantising_fresh_keys():
    g = torch.Generator().manual_seed(0)
    gain = torch.rand(TINY.n_heads, TINY.head_dim, generator=g) + 0.5
    k = rms_heads(g, TINY.n_heads, 600, TINY.head_dim) * gain.unsqueeze(1)
    scale = fp8.per_head_scale(gain)
    at = lambda p: cos_sin(temporal_delta_angles(TINY, p), torch.float32, "cpu")
    stored = fp8.quantize(apply_rope(k, *at(40.0)), scale)
    rotated = fp8.quantize(apply_rope(fp8.dequantize(stored, scale), *at(-5.0)), scale)
    exact = apply_rope(k, *at(35.0))
    fresh = fp8.quantize(exact, scale)
    units = scale.view(-1, 1, 1)
    diff = (fp8.dequantize(rotated, scale) - fp8.dequantize(fresh, scale)).abs() / units
    pair_norm = (exact / units).unflatten(-1, (-1, 2)).norm(dim=-1).repeat_interleave(2, -1)
    # Bound: one e4m3 step at the magnitude of the rotated pair (measured max: 1.0 step).
    assert (diff <= fp8.relative_step(pair_norm) * (1 + 1e-5)).all()
    assert (rotated.float() == fresh.float()).float().mean() > 0.8


def test_long_session_reference_keys_stay_fresh():
    """3,600 steps (10 minutes at 6 steps/s), a reset every 5: the sink keys equal fresh FP8 keys."""
    spec = TINY
    g = torch.Generator().manual_seed(1)
    gains = [torch.rand(spec.n_heads, spec.head_dim, generator=g) + 0.5 for _ in range(spec.n_blocks)]
    cache = RingKVCache(spec, gains, gains, kv_dtype="fp8")
    sink_master = [rms_heads(g, spec.n_heads, spec.reference_tokens, spec.head_dim) * gn.unsqueeze(1) for gn in gains]
    for layer in range(spec.n_blocks):
        q = torch.zeros_like(sink_master[layer])
        cache.reference_attend(layer, q, sink_master[layer], sink_master[layer])
    frame = rms_heads(g, spec.n_heads, spec.frame_tokens, spec.head_dim)
    for t in range(3600):
        cache.begin_step(t)
        for layer in range(spec.n_blocks):
            cache.write(layer, frame * gains[layer].unsqueeze(1), frame)
        cache.end_step()
    assert cache.resets == 3599 // spec.reset_every
    n = spec.reference_tokens
    cos, sin = cache.rope.reference(float(cache.position - spec.sink_distance))
    for layer in range(spec.n_blocks):
        exact = apply_rope(sink_master[layer], cos, sin)
        cached = fp8.dequantize(cache.k[layer, :, :n], cache.k_scale[layer])
        fresh = fp8.dequantize(fp8.quantize(exact, cache.k_scale[layer]), cache.k_scale[layer])
        assert torch.equal(cached, fresh)
        # and within the FP8 bound (half a step, relative 2^-4) of the exact keys
        units = cache.k_scale[layer].view(-1, 1, 1)
        assert ((cached - exact).abs() / units <= 0.5 * fp8.relative_step(exact / units) + 1e-6).all()
    # The newest frame's keys, written this step, are fresh too.
    slot = cache.frame_slot(cache.step)
    cos_f, sin_f = cache.rope.frame(float(cache.position))
    exact = apply_rope(frame * gains[0].unsqueeze(1), cos_f, sin_f)
    cached = fp8.dequantize(cache.k[0, :, slot:slot + spec.frame_tokens], cache.k_scale[0])
    assert torch.equal(cached, fp8.dequantize(fp8.quantize(exact, cache.k_scale[0]), cache.k_scale[0]))


def test_repeated_requantising_rotation_would_drift():
    # Why the sink is re-derived: rotating FP8 keys again and again compounds rounding.
    g = torch.Generator().manual_seed(2)
    gain = torch.ones(TINY.n_heads, TINY.head_dim)
    k = rms_heads(g, TINY.n_heads, 64, TINY.head_dim)
    scale = fp8.per_head_scale(gain)
    cos, sin = cos_sin(temporal_delta_angles(TINY, -5.0), torch.float32, "cpu")
    q = fp8.quantize(k, scale)
    for _ in range(720):
        q = fp8.quantize(apply_rope(fp8.dequantize(q, scale), cos, sin), scale)
    exact = apply_rope(k, *cos_sin(temporal_delta_angles(TINY, -5.0 * 720), torch.float32, "cpu"))
    drift = (fp8.dequantize(q, scale) - exact).norm() / exact.norm()
    once = (fp8.dequantize(fp8.quantize(exact, scale), scale) - exact).norm() / exact.norm()
    assert drift > 5 * once


def test_ring_reads_only_written_slots():
    model = tiny_model()
    from engine.session import EngineSession
    from tests.helpers import reference_latent

    s = EngineSession(model, kv_dtype="fp32")
    s.start(reference_latent())
    valid = s.cache.valid
    assert valid[: TINY.reference_tokens].all() and not valid[TINY.reference_tokens:].any()
    s.step()
    assert valid.sum().item() == TINY.reference_tokens + TINY.frame_tokens


def test_unpadded_sink_reads_the_live_prefix_unmasked_and_still_matches_reference():
    """With no padding between the sink and the ring, the live slots are a prefix known from the
    step count: attention reads that slice without a mask (SDPA's fused kernel). Same tolerance as
    the masked ring: 1e-5 against the reference path, across the window filling and resets."""
    from engine.model import build_model

    spec = TINY.with_(name="tiny-unpadded", sink_slots=TINY.reference_tokens)
    model = build_model(spec, seed=1)
    ring = run_session(model, STEPS, cache="ring", kv_dtype="fp32")
    reference = run_session(model, STEPS, cache="reference")
    assert (ring - reference).abs().max().item() <= 1e-5
    cache = RingKVCache(spec, [b.k_norm.weight for b in model.blocks], [b.v_norm.weight for b in model.blocks], kv_dtype="fp32")
    assert cache.live_prefix() is None  # nothing written yet
    cache.step = 0
    assert cache.live_prefix() == spec.sink_slots + spec.frame_tokens
    cache.step = 10 * spec.window_frames
    assert cache.live_prefix() == spec.cache_slots
    padded = RingKVCache(TINY, [b.k_norm.weight for b in tiny_model().blocks], [b.v_norm.weight for b in tiny_model().blocks],
                         kv_dtype="fp32")
    padded.step = 3
    assert padded.live_prefix() is None  # sink padding: a hole, so the mask stays


def test_the_torch_ring_builds_each_positions_rope_table_once(monkeypatch):
    """Positions repeat every reset period, so after the first period the ring's cos/sin tables are all kept: none
    is rebuilt (and copied to the device) per step, at the 57b spec's reset period of 42 steps too."""
    import engine.cache

    built = []
    real = engine.cache.cos_sin
    monkeypatch.setattr(engine.cache, "cos_sin", lambda *a, **k: built.append(1) or real(*a, **k))
    model = tiny_model()
    cache = RingKVCache(TINY, [b.k_norm.weight for b in model.blocks], [b.v_norm.weight for b in model.blocks],
                        kv_dtype="fp32", reset_every=42)
    for step in range(42):
        cache.begin_step(step)
        cache._frame_cos_sin()
    first_period = len(built)
    for step in range(42, 3 * 42):
        cache.begin_step(step)
        cache._frame_cos_sin()
    assert len(built) == first_period
