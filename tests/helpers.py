"""Shared test fixtures: tiny-spec sessions run the same way across tests."""

from __future__ import annotations

import torch

from engine.config import get_spec
from engine.model import build_model
from engine.session import EngineSession

TINY = get_spec("tiny")


def tiny_model(seed: int = 1):
    return build_model(TINY, seed=seed)


def reference_latent(spec=TINY, seed: int = 3) -> torch.Tensor:
    return torch.randn(spec.latent_channels, *spec.latent_grid, generator=torch.Generator().manual_seed(seed))


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
