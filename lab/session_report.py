"""The seed's health figure from the session log: the share of sessions that lasted at least a second and
fell behind 24 fps on average.

The seed counts sessions that averaged 24 fps or less, for renderers that run ahead of the
frame rate. Playout here releases frames on a 24 fps clock, so a session with no underrun
averages 24 fps to within the clock's rounding (about 1e-9 either side); a session counts as
behind when it averaged below 24 fps by more than `tolerance` (0.1%: an underrun of one frame
in a minute).

    python -m lab.session_report --log sessions.jsonl --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from engine.session_log import default_log


def summarize(path: str | Path, fps: float = 24.0, min_seconds: float = 1.0, tolerance: float = 1e-3) -> dict:
    """Share of sessions of at least `min_seconds` averaging below `fps` by more than `tolerance` (relative);
    unreadable lines are counted, not fatal."""
    sessions, bad = [], 0
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"session log {path} is a folder: give the JSON-lines file")
    if not path.is_file():
        raise ValueError(f"session log not found: {path}")
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():  # a damaged line is one more unreadable
        try:
            row = json.loads(line)
            sessions.append((float(row["seconds"]), float(row["fps"])))
        except (ValueError, KeyError, TypeError):
            bad += 1
    counted = [s for s in sessions if s[0] >= min_seconds]
    slow = [s for s in counted if s[1] < fps * (1 - tolerance)]
    return {"log": str(path), "sessions": len(sessions), "counted": len(counted), "unreadable_lines": bad,
            f"share_below_{fps:g}_fps": (len(slow) / len(counted)) if counted else None,
            "median_fps": statistics.median(f for _, f in counted) if counted else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.session_report", description=__doc__.strip().splitlines()[0])
    p.add_argument("--log", default=None, help=f"session log (default {default_log()})")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = p.parse_args(argv)
    try:
        print(json.dumps(summarize(args.log or default_log())))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
