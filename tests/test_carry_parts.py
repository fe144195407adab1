"""lab/device/carry_parts.py: files split into parts, received one by one, assembled and verified."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lab" / "device"))
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
    out = subprocess.run([sys.executable, str(root / "lab" / "device" / "with_site.py"), str(site_dir), "probe_mod", "--x", "1"],
                         cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == '{"args": ["--x", "1"]}'
    bad = subprocess.run([sys.executable, str(root / "lab" / "device" / "with_site.py"), str(site_dir)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "usage" in bad.stderr
    # a copy of an installed package: the interpreter's wins, unless --first (the standard library always wins)
    (site_dir / "yaml.py").write_text("OURS = True\n")
    (site_dir / "probe_first.py").write_text("import json, yaml\nprint(hasattr(yaml, 'OURS'))\n")
    for flag, ours in (([], "False"), (["--first"], "True")):
        out = subprocess.run([sys.executable, str(root / "lab" / "device" / "with_site.py"), *flag, str(site_dir), "probe_first"],
                             cwd=root, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == ours, (flag, out.stdout, out.stderr)


def _deb(path, files: dict[str, bytes], compression: str = "xz"):
    """A minimal Debian package: ar archive of debian-binary, control.tar.gz and data.tar.<compression>."""
    import io
    import tarfile

    def tar_bytes(entries: dict[str, bytes | str], mode: str) -> bytes:  # str: a symbolic link to that target
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=mode) as t:
            for name, data in entries.items():
                info = tarfile.TarInfo(name)
                if isinstance(data, str):
                    info.type, info.linkname = tarfile.SYMTYPE, data
                    t.addfile(info)
                    continue
                info.size, info.mode = len(data), 0o755
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    members = [("debian-binary", b"2.0\n"), ("control.tar.gz", tar_bytes({"./control": b"Package: x\n"}, "w:gz")),
               (f"data.tar.{compression}", tar_bytes(files, f"w:{compression}") if compression != "zst" else b"\0" * 7)]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(out)
    return path


def test_debs_unpack_under_a_folder_and_bad_ones_are_named(tmp_path):
    main, unpack_debs = carry_parts.main, carry_parts.unpack_debs

    a = _deb(tmp_path / "a.deb", {"./usr/lib/x/tool": b"#!/bin/sh\necho hi\n", "./usr/share/doc/x/README": b"odd-sized"})
    b = _deb(tmp_path / "b.deb", {"./usr/lib/y/libz.so.1": b"\x7fELF"}, compression="gz")
    c = _deb(tmp_path / "c.deb", {"./usr/share/conf/a.conf": b"x", "./etc/conf.d/a.conf": "/usr/share/conf/a.conf"})
    assert unpack_debs([a, b, c], tmp_path / "root") == 4
    assert unpack_debs([c], tmp_path / "root") == 1  # again over the same tree
    assert (tmp_path / "root/etc/conf.d/a.conf").read_bytes() == b"x"  # the absolute link now points inside
    assert not os.readlink(tmp_path / "root/etc/conf.d/a.conf").startswith("/")
    assert (tmp_path / "root/usr/lib/x/tool").read_bytes().startswith(b"#!/bin/sh")
    assert (tmp_path / "root/usr/lib/y/libz.so.1").read_bytes() == b"\x7fELF"
    out = _deb(tmp_path / "out.deb", {"./usr/lib/evil": "../../../../etc/passwd"})  # a link leaving the folder
    assert main(["unpack-debs", str(out), "--into", str(tmp_path / "r1")]) == 2
    (tmp_path / "not.deb").write_bytes(b"PK\x03\x04")
    assert main(["unpack-debs", str(tmp_path / "not.deb"), "--into", str(tmp_path / "r2")]) == 2
    assert main(["unpack-debs", str(_deb(tmp_path / "z.deb", {}, "zst")), "--into", str(tmp_path / "r3")]) == 2
