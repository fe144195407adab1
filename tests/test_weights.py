"""Checkpoints: round trip, sha256 verification, spec mismatch."""

import pytest
import torch

from engine.config import get_spec
from engine.model import build_model
from engine.weights import load_checkpoint, save_checkpoint
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
    n = big.param_count()
    assert 45e9 < n < 60e9
