"""Move files larger than one device call can carry, in parts, over several calls to the same machine.

The device machine takes the working tree plus carried folders up to a fixed size per call,
and keeps its /tmp while it stays warm between calls. So: split here, carry one part per
call (each call copies its part into a store under /tmp), then assemble and verify there.

    python lab/device/carry_parts.py split --out .carry/voice --part-mib 22 wheels/*.whl   # here
    python3 lab/device/carry_parts.py receive .carry/voice/p03 --store /tmp/parts           # there, one per call
    python3 lab/device/carry_parts.py assemble --store /tmp/parts --out /tmp/wheels        # there, last
    python3 lab/device/carry_parts.py unpack-debs /tmp/wheels/*.deb --into /tmp/chromium   # there, for .debs

`assemble` checks every file's sha256 and names the parts still missing. `unpack-debs` extracts
Debian packages' files under a folder (never /), with no dpkg needed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(files: list[Path], out: Path, part_bytes: int) -> dict:
    """Concatenate `files` into one stream cut into parts of at most `part_bytes`, each in its own folder."""
    if part_bytes <= 0:
        raise ValueError("--part-mib must be positive")
    for f in files:
        if not f.is_file():
            raise ValueError(f"not a file: {f}")
    if out.exists():
        shutil.rmtree(out)
    manifest = {"files": [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)} for f in files], "parts": []}
    total = sum(e["bytes"] for e in manifest["files"])
    n_parts = max(1, -(-total // part_bytes))
    manifest["parts"] = [f"p{i + 1:02d}" for i in range(n_parts)]
    chunks = (open(f, "rb") for f in files)
    current = next(chunks, None)
    for name in manifest["parts"]:
        folder = out / name
        folder.mkdir(parents=True)
        left = part_bytes
        with open(folder / "data", "wb") as dst:
            while left > 0 and current is not None:
                block = current.read(min(left, 1 << 20))
                if not block:
                    current.close()
                    current = next(chunks, None)
                    continue
                dst.write(block)
                left -= len(block)
        (folder / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def receive(part: Path, store: Path) -> str:
    if not (part / "data").is_file() or not (part / MANIFEST).is_file():
        raise ValueError(f"{part} is not a part folder (data + {MANIFEST})")
    store.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part / "data", store / part.name)
    shutil.copyfile(part / MANIFEST, store / MANIFEST)
    return part.name


def assemble(store: Path, out: Path) -> list[str]:
    manifest_path = store / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"no part received yet in {store}")
    manifest = json.loads(manifest_path.read_text())
    missing = [p for p in manifest["parts"] if not (store / p).is_file()]
    if missing:
        raise ValueError(f"parts still missing: {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    parts = (open(store / p, "rb") for p in manifest["parts"])
    current = next(parts)
    written = []
    for entry in manifest["files"]:
        left = entry["bytes"]
        with open(out / entry["name"], "wb") as dst:
            while left > 0:
                block = current.read(min(left, 1 << 20))
                if not block:
                    current.close()
                    current = next(parts)
                    continue
                dst.write(block)
                left -= len(block)
        if sha256(out / entry["name"]) != entry["sha256"]:
            raise ValueError(f"{entry['name']}: checksum mismatch after assembly")
        written.append(entry["name"])
    return written


def _deb_data(deb: Path) -> tuple[str, bytes]:
    """The name and bytes of a .deb's data archive (its `ar` member data.tar.*)."""
    with open(deb, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb} is not a Debian package (no ar header)")
        while len(header := f.read(60)) == 60:
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
            if name.startswith("data.tar"):
                return name, f.read(size)
            f.seek(size + size % 2, 1)  # members are 2-byte aligned
    raise ValueError(f"{deb} has no data.tar member")


def unpack_debs(debs: list[Path], into: Path) -> int:
    """Extract each .deb's data archive under `into`; returns the files written."""
    into.mkdir(parents=True, exist_ok=True)
    count = 0
    for deb in debs:
        name, data = _deb_data(deb)
        if name.endswith(".zst"):
            raise ValueError(f"{deb}: {name} is zstd-compressed, which Python's tarfile cannot read")
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = [m for m in tar.getmembers() if not m.isdev()]
            for m in members:  # a link to /x points to into/x instead: the tree stands on its own
                if m.issym() and m.linkname.startswith("/"):
                    here = os.path.dirname(os.path.normpath(m.name))
                    m.linkname = os.path.relpath(m.linkname.lstrip("/") or ".", here or ".")
            try:  # "data": no member and no link may leave the folder
                tar.extractall(into, members=members, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise ValueError(f"{deb}: {e}") from e
            count += sum(m.isfile() for m in members)
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python lab/device/carry_parts.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("files", nargs="+", type=Path)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--part-mib", type=float, default=22.0)
    r = sub.add_parser("receive")
    r.add_argument("part", type=Path)
    r.add_argument("--store", type=Path, required=True)
    a = sub.add_parser("assemble")
    a.add_argument("--store", type=Path, required=True)
    a.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack-debs")
    u.add_argument("debs", nargs="+", type=Path)
    u.add_argument("--into", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            m = split(args.files, args.out, int(args.part_mib * 2**20))
            print(f"{len(m['files'])} files in {len(m['parts'])} parts under {args.out}: {' '.join(m['parts'])}")
        elif args.cmd == "receive":
            print(f"received {receive(args.part, args.store)} into {args.store}")
        elif args.cmd == "unpack-debs":
            print(f"{unpack_debs(args.debs, args.into)} files from {len(args.debs)} packages under {args.into}")
        else:
            print("assembled and verified:", " ".join(assemble(args.store, args.out)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
