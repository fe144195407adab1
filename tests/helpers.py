"""Shared test fixtures: tiny-spec sessions run the same way across tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from engine import fp8
from engine.config import get_spec
from engine.model import build_model
from engine.session import EngineSession

TINY = get_spec("tiny")
ROOT = Path(__file__).resolve().parent.parent


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_script(path: Path, text: str, timeout: float) -> subprocess.CompletedProcess:
    """Write `text` to `path` and run it as a fresh Python process from the repository root (its own interpreter
    start and exit, what the test looks at), stdout and stderr captured."""
    path.write_text(text)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def tiny_model(seed: int = 1):
    return build_model(TINY, seed=seed)


def reference_latent(spec=TINY, seed: int = 3) -> torch.Tensor:
    return torch.randn(spec.latent_channels, *spec.latent_grid, generator=torch.Generator().manual_seed(seed))


def started_tiny_session(**session_kwargs) -> tuple[EngineSession, torch.Tensor]:
    """A started session of the tiny model (seed 0) and one step's silent audio features, for the benchmark's
    timing helpers to drive."""
    model = tiny_model()
    session = EngineSession(model, seed=0, **session_kwargs)
    session.start(reference_latent(model.spec))
    return session, torch.zeros(model.spec.frames_per_latent, model.spec.n_mels)


def run_session(model, steps: int, *, audio_seed: int = 7, seed: int = 5, **session_kwargs) -> torch.Tensor:
    """Latents (steps, C, h, w) of a session fed random audio features, one step's worth at a time."""
    spec = model.spec
    session = EngineSession(model, seed=seed, **session_kwargs)
    session.start(reference_latent(spec))
    g = torch.Generator().manual_seed(audio_seed)
    out = []
    for _ in range(steps):
        session.push_audio_features(torch.randn(spec.frames_per_latent, spec.n_mels, generator=g))
        out.append(session.step())
    return torch.stack(out)


def rms_heads(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Gaussian vectors scaled to unit RMS along the last axis (head-normed q, k or v)."""
    x = torch.randn(*shape, generator=g)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def assert_e4m3_output_is_bf16_output_rounded(out8: torch.Tensor, out16: torch.Tensor, o_scale: torch.Tensor) -> None:
    """out8 * o_scale is out16 rounded to e4m3: within half an e4m3 step, plus one bf16 step for out16's own
    rounding (the interpreter truncates to bf16)."""
    x, o8 = out16.float() / o_scale, out8.float()
    step = fp8.relative_step(torch.maximum(x.abs(), o8.abs()))
    assert torch.isfinite(o8).all()
    assert ((o8 - x).abs() <= 0.5 * step + 2.0**-7 * x.abs() + 1e-6).all()


def v_scale_worst_case(g: torch.Generator, H: int, S: int, D: int, device) -> tuple[torch.Tensor, ...]:
    """Scales per head (head 0's the largest) and a Vᵀ whose head 0 holds e4m3's largest value in every slot:
    each of that head's outputs is then 448 * v_scale times the ratio of rounded to unrounded probabilities."""
    scale = fp8.per_head_scale(torch.linspace(2.0, 0.5, H)[:, None].expand(H, D)).to(device)
    vt8 = fp8.quantize(rms_heads(g, H, S, D).to(device), scale).transpose(1, 2).contiguous()
    vt8[0] = torch.tensor(fp8.FP8_MAX).to(fp8.FP8)
    return scale, vt8


def assert_e4m3_output_never_saturates(attention, q8, k8, vt8, valid, scale: torch.Tensor, n_slots: int) -> torch.Tensor:
    """Runs `attention` into a bf16 and an e4m3 `out` (V's scales divided by `out_scale`): the e4m3 output is the bf16
    one rounded, and head 0 (V at e4m3's largest value, `v_scale_worst_case`) stays below 448, unsaturated.
    Returns the bf16 output."""
    from engine.kernels.fp8_attention import out_scale, qk_scale

    H, M, D = q8.shape
    out16 = torch.empty(M, H * D, dtype=torch.bfloat16, device=q8.device)
    out8 = torch.empty(M, H * D, dtype=fp8.FP8, device=q8.device)
    o_scale = out_scale(scale, n_slots)
    attention(q8, k8, vt8, valid, qk_scale(scale, scale, D), scale, out16)
    attention(q8, k8, vt8, valid, qk_scale(scale, scale, D), scale / o_scale, out8)
    assert_e4m3_output_is_bf16_output_rounded(out8, out16, o_scale)
    top = out8[:, :D].float()
    assert top.min() > 300 and top.max() < fp8.FP8_MAX
    return out16
