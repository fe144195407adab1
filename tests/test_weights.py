"""Checkpoints: round trip, sha256 verification, spec mismatch, crash-safe writes, DiT and codec pairs."""

import os

import pytest
import torch

from engine import checkpoint
from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.codec import build_codec, save_codec
from engine.config import get_spec
from engine.model import build_model, count_parameters
from engine.weights import load_engine
from tests.helpers import TINY


def test_round_trip(tmp_path):
    a, b = build_model(TINY, seed=1), build_model(TINY, seed=2)
    save_checkpoint(a, TINY, tmp_path / "m.pt")
    load_checkpoint(b, TINY, tmp_path / "m.pt")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_tampered_checkpoint_fails_its_checksum(tmp_path):
    path = tmp_path / "m.pt"
    save_checkpoint(build_model(TINY), TINY, path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_checkpoint(build_model(TINY), TINY, path)


def test_checkpoint_for_another_spec_is_refused(tmp_path):
    path = tmp_path / "m.pt"
    save_checkpoint(build_model(TINY), TINY, path)
    other = TINY.with_(n_blocks=3)
    with pytest.raises(ValueError, match="n_blocks"):
        load_checkpoint(build_model(other), other, path)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_checkpoint(build_model(TINY), TINY, tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable"):
        load_checkpoint(build_model(TINY), TINY, tmp_path / "junk.pt")


def test_param_counts():
    big = get_spec("characters-57b")
    n = count_parameters(big)
    assert 45e9 < n < 60e9


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _crash_on(calls: int, real):
    """A stand-in for `real` that raises on its call number `calls` (0-based), as a kill there would stop it."""
    count, writes = [0], real is torch.save

    def wrapper(*args, **kwargs):
        count[0] += 1
        if count[0] - 1 == calls:
            if writes:  # a kill mid-write leaves half a file
                real(*args, **kwargs)
                with open(args[1], "r+b") as f:
                    f.truncate(os.path.getsize(args[1]) // 2)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("target, calls", [(torch.save, 0), (os.replace, 0), (os.replace, 1)])
def test_a_save_killed_at_any_point_leaves_loadable_weights(tmp_path, monkeypatch, target, calls):
    """Old or new weights, whole and never beside the other's digest: the next load succeeds."""
    path = tmp_path / "m.pt"
    old, new = build_model(TINY, seed=1), build_model(TINY, seed=2)
    save_checkpoint(old, TINY, path)
    holder, name = (checkpoint.torch, "save") if target is torch.save else (checkpoint.os, "replace")
    monkeypatch.setattr(holder, name, _crash_on(calls, target))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(new, TINY, path)
    monkeypatch.undo()
    loaded = build_model(TINY, seed=3)
    load_checkpoint(loaded, TINY, path)
    assert _same_weights(loaded, old) or _same_weights(loaded, new)
    save_checkpoint(new, TINY, path)  # the next save completes the pair
    load_checkpoint(loaded, TINY, path)
    assert _same_weights(loaded, new) and (tmp_path / "m.pt.sha256").is_file()


def test_a_dit_checkpoint_without_its_codec_is_refused(tmp_path):
    dit = tmp_path / "demo-dit-latest.pt"
    save_checkpoint(build_model(TINY, seed=1), TINY, dit)
    with pytest.raises(ValueError, match="expected .*demo-dit-latest-codec.pt"):
        load_engine(TINY, weights=dit)
    _, codec, trained = load_engine(TINY, weights=dit, stand_in_codec=True)  # asked for: not reported as trained
    assert type(codec).__name__ == "StandInCodec" and trained is False
    save_codec(build_codec(TINY), tmp_path / "demo-dit-latest-codec.pt")
    _, codec, trained = load_engine(TINY, weights=dit)
    assert type(codec).__name__ == "TrainedCodec" and trained is True
