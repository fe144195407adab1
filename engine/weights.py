"""Checkpoints: weights with the spec they were made for, verified by sha256 at load."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from engine.config import ModelSpec


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


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(module: nn.Module, spec: ModelSpec, path: str | Path) -> str:
    """Write weights + spec, and `<path>.sha256` beside them; returns the digest."""
    path = Path(path)
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    torch.save({"spec": spec.to_dict(), "state_dict": state}, path)
    digest = sha256_of(path)
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return digest


def load_checkpoint(module: nn.Module, spec: ModelSpec, path: str | Path, *, expected_sha256: str | None = None) -> None:
    """Load weights into `module`; clear errors for a missing, tampered or mismatched file.

    The digest comes from `expected_sha256` or else the `<path>.sha256` file beside it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint not found: {path}")
    sidecar = path.with_name(path.name + ".sha256")
    if expected_sha256 is None and sidecar.is_file():
        expected_sha256 = sidecar.read_text().split()[0]
    if expected_sha256 is not None:
        actual = sha256_of(path)
        if actual != expected_sha256:
            raise ValueError(f"checkpoint {path} fails its sha256 check: expected {expected_sha256}, got {actual}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is not a readable talkloop checkpoint: {e}") from e
    if not isinstance(blob, dict) or "spec" not in blob or "state_dict" not in blob:
        raise ValueError(f"checkpoint {path} lacks its spec or weights")
    saved = blob["spec"]
    mismatched = {k: (saved.get(k), v) for k, v in spec.to_dict().items() if _norm(saved.get(k)) != _norm(v)}
    if mismatched:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs spec {b!r}" for k, (a, b) in mismatched.items())
        raise ValueError(f"checkpoint {path} does not match spec {spec.name}: {detail}")
    missing, unexpected = module.load_state_dict(blob["state_dict"], strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")


def _norm(x):
    return list(x) if isinstance(x, tuple) else x


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def default_weights(spec: ModelSpec) -> Path | None:
    """The shipped checkpoint for a spec, if there is one."""
    path = ASSETS / f"{spec.name}.pt"
    return path if path.is_file() else None


def load_engine(spec: ModelSpec, *, weights: str | Path | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0):
    """Model + codec for a spec: the given or shipped checkpoint, else random weights.

    The trained codec is the checkpoint beside the DiT's, `<name>-codec.pt` (assets/demo.pt ->
    assets/demo-codec.pt), sha256-verified like it; without one the stand-in codec is used.
    Returns (model, codec, trained) where `trained` says whether real weights were loaded.
    """
    from engine.codec import load_codec
    from engine.decoder import StandInCodec
    from engine.model import build_model

    model = build_model(spec, seed=seed, device="cpu", dtype=torch.float32)
    path = Path(weights) if weights is not None else default_weights(spec)
    if path is not None:
        load_checkpoint(model, spec, path)
    codec_file = (path.with_name(path.stem + "-codec.pt") if path is not None else ASSETS / f"{spec.name}-codec.pt")
    if codec_file.is_file():
        codec = load_codec(spec, codec_file).to(device=device, dtype=dtype)
    else:
        codec = StandInCodec(spec, seed=seed).to(device)
    return model.to(device=device, dtype=dtype).eval(), codec, path is not None
