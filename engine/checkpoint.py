"""Checkpoint files: weights with the spec they were made for, written atomically, verified by sha256 at load."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from engine.config import ModelSpec


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sidecar_of(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _fsync(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _move_into_place(tmp: Path, path: Path) -> str:
    """Move a fully written `tmp` onto `path` with a new sidecar; returns the digest.

    Order: the old sidecar is removed first, then the weights replaced, then the new sidecar
    moved in. os.replace is atomic, so a crash at any point leaves whole weights (old or new)
    beside their own digest or beside none (loaded unchecked), never beside the other's digest.
    """
    digest = sha256_of(tmp)
    sidecar = sidecar_of(path)
    sidecar_tmp = sidecar.with_name(sidecar.name + ".tmp")
    sidecar_tmp.write_text(f"{digest}  {path.name}\n")
    sidecar.unlink(missing_ok=True)
    os.replace(tmp, path)
    os.replace(sidecar_tmp, sidecar)
    return digest


def save_checkpoint(module: nn.Module, spec: ModelSpec, path: str | Path) -> str:
    """Write weights + spec, and `<path>.sha256` beside them, atomically; returns the digest."""
    path = Path(path)
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"spec": spec.to_dict(), "state_dict": state}, tmp)
    _fsync(tmp)
    return _move_into_place(tmp, path)


def install_checkpoint(source: str | Path, path: str | Path) -> str:
    """Copy a checkpoint (checked against its own sidecar first) to `path`, as atomically as save_checkpoint."""
    source, path = Path(source), Path(path)
    expected = sidecar_of(source).read_text().split()[0] if sidecar_of(source).is_file() else None
    tmp = path.with_name(path.name + ".tmp")
    shutil.copyfile(source, tmp)
    _fsync(tmp)
    if expected is not None and sha256_of(tmp) != expected:
        tmp.unlink()
        raise ValueError(f"checkpoint {source} fails its sha256 check: not installed to {path}")
    return _move_into_place(tmp, path)


def remove_checkpoint(path: str | Path) -> None:
    """Delete a checkpoint and its sidecar (sidecar last: a crash between leaves no weights to load)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    sidecar_of(path).unlink(missing_ok=True)


def load_checkpoint(module: nn.Module, spec: ModelSpec, path: str | Path, *, expected_sha256: str | None = None) -> None:
    """Load weights into `module`; clear errors for a missing, tampered or mismatched file.

    The digest comes from `expected_sha256` or else the `<path>.sha256` file beside it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint not found: {path}")
    sidecar = sidecar_of(path)
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
