"""tools/carry_parts.py: files split into parts, received one by one, assembled and verified."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import carry_parts  # noqa: E402


def test_split_receive_assemble_round_trip_and_errors(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name, size in (("a.whl", 5000), ("b.bin", 1), ("c.whl", 12345)):
        (src / name).write_bytes(os.urandom(size))
        files.append(src / name)
    manifest = carry_parts.split(files, tmp_path / "carry", part_bytes=4096)
    assert manifest["parts"] == [f"p{i:02d}" for i in range(1, 6)]  # 17346 bytes / 4096
    store, out = tmp_path / "store", tmp_path / "out"
    for part in manifest["parts"][:-1]:
        carry_parts.receive(tmp_path / "carry" / part, store)
    with pytest.raises(ValueError, match="parts still missing: p05"):
        carry_parts.assemble(store, out)
    carry_parts.receive(tmp_path / "carry" / "p05", store)
    assert carry_parts.assemble(store, out) == ["a.whl", "b.bin", "c.whl"]
    for f in files:
        assert (out / f.name).read_bytes() == f.read_bytes()
    damaged = bytearray((store / "p02").read_bytes())
    damaged[7] ^= 0xFF
    (store / "p02").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="checksum mismatch"):
        carry_parts.assemble(store, tmp_path / "out2")


def test_with_site_runs_a_module_with_the_folder_after_the_interpreters_own(tmp_path):
    import subprocess

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "json.py").write_text("raise RuntimeError('shadowed the standard library')\n")
    (site_dir / "probe_mod.py").write_text("import json, sys\nprint(json.dumps({'args': sys.argv[1:]}))\n")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "tools" / "with_site.py"), str(site_dir), "probe_mod", "--x", "1"],
                         cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '{"args": ["--x", "1"]}'
    bad = subprocess.run([sys.executable, str(root / "tools" / "with_site.py"), str(site_dir)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "usage" in bad.stderr
