"""The engine's weights: the device they go to, the shipped checkpoints, and `load_engine` (model + codec)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint import load_checkpoint
from engine.codec import StandInCodec, load_codec
from engine.config import ModelSpec
from engine.model import build_model


def pick_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> a device; a clear error when CUDA is asked for but absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} asked for, but no CUDA GPU is visible")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {name!r}: use auto, cpu, cuda or cuda:N")
    return device


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def default_weights(spec: ModelSpec) -> Path | None:
    """The shipped checkpoint for a spec, if there is one."""
    path = ASSETS / f"{spec.name}.pt"
    return path if path.is_file() else None


def load_engine(spec: ModelSpec, *, weights: str | Path | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0, stand_in_codec: bool = False):
    """Model + codec for a spec: the given or shipped checkpoint, else random weights.

    The trained codec is the checkpoint beside the DiT's, `<name>-codec.pt` (assets/demo.pt ->
    assets/demo-codec.pt), sha256-verified like it. A DiT checkpoint without its codec is an
    error (its pictures would come through a random codec) unless `stand_in_codec` asks for
    the stand-in one. Returns (model, codec, trained) where `trained` says whether both the
    DiT and the codec are trained weights.
    """
    model = build_model(spec, seed=seed, device="cpu", dtype=torch.float32)
    path = Path(weights) if weights is not None else default_weights(spec)
    if path is not None:
        load_checkpoint(model, spec, path)
    codec_file = (path.with_name(path.stem + "-codec.pt") if path is not None else ASSETS / f"{spec.name}-codec.pt")
    if codec_file.is_file():
        codec = load_codec(spec, codec_file).to(device=device, dtype=dtype)
    elif path is not None and not stand_in_codec:
        raise ValueError(f"DiT checkpoint {path} has no codec beside it: expected {codec_file} "
                         "(the codec trained with it)")
    else:
        codec = StandInCodec(spec, seed=seed).to(device)
    trained = path is not None and codec_file.is_file()
    return model.to(device=device, dtype=dtype).eval(), codec, trained
