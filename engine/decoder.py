"""Latent <-> RGB frames: the decoder seam.

A decoder turns one latent frame (C, h, w) into `frames_per_latent` RGB frames
(uint8, (4, H, W, 3)); its encoder turns a reference picture into the latent the
session starts from. `StandInCodec` has the right shapes and no training: a fixed
random per-pixel projection, upsampled. Trained codecs load through the same seam.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelSpec


class Codec(Protocol):
    spec: ModelSpec

    def decode(self, latent: torch.Tensor) -> torch.Tensor: ...  # (C, h, w) -> (4, H, W, 3) uint8

    def encode_reference(self, image: torch.Tensor) -> torch.Tensor: ...  # (H, W, 3) uint8 -> (C, h, w)


def check_image(image: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[-1] != 3:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"reference image must be (H, W, 3), got {shape}")
    if image.dtype == torch.uint8:
        image = image.float() / 255.0
    if not torch.isfinite(image).all():
        raise ValueError("reference image contains NaN or infinite values")
    return image.permute(2, 0, 1)  # (3, H, W) in [0, 1]


class StandInCodec(nn.Module):
    """Right shapes, no training: stands in until a trained autoencoder is shipped."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        c, k = spec.latent_channels, spec.frames_per_latent
        self.register_buffer("to_rgb", torch.randn(k * 3, c, generator=g) / c**0.5)
        self.register_buffer("to_latent", torch.randn(c, 3, generator=g))

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        k = self.spec.frames_per_latent
        rgb = torch.einsum("oc,chw->ohw", self.to_rgb.to(latent), latent)  # (4*3, h, w)
        rgb = F.interpolate(rgb[None].float(), size=self.spec.image_size, mode="bilinear", align_corners=False)[0]
        rgb = torch.sigmoid(rgb).reshape(k, 3, *self.spec.image_size).permute(0, 2, 3, 1)
        return (rgb * 255).round().to(torch.uint8)

    @torch.no_grad()
    def encode_reference(self, image: torch.Tensor) -> torch.Tensor:
        x = check_image(image, self.spec).to(self.to_latent.device)
        x = F.interpolate(x[None], size=self.spec.latent_grid, mode="area")[0]  # (3, h, w)
        return torch.einsum("cr,rhw->chw", self.to_latent, x * 2 - 1)
