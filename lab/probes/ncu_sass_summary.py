"""Where one attention call's warps stall, instruction by instruction, from Nsight Compute's source page.

    python -m lab.probes.ncu_sass_summary docs/results/ncu_attention_ws_sass_h200.csv.gz   # prints one JSON object

The input is `ncu --page source --csv --print-source sass` of a report with the SourceCounters section
(`bash lab/device/gpu_suite.sh attention-ncu-source`). Instructions are grouped by how often they ran: the
consumer's loop body runs once per K/V block per warp, far more often than anything else, so the
instructions executed at least half as often as the most executed one are "the loop"; the rest are the
producer warp, the prologue and epilogue, and the warps that only wait for the others to finish.
For the loop it gives the stall reasons, the opcodes, and the five instructions holding most of its samples.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import json
import sys
from pathlib import Path


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rows = list(csv.reader(io.StringIO(raw.decode())))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summary(path: Path) -> dict:
    header, rows = read_rows(path)
    col = {name: i for i, name in enumerate(header)}
    samples, executed, source = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"], col["Source"]
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    most = max(number(r[executed]) for r in rows)
    groups: dict[str, list[list[str]]] = {"loop": [], "rest": []}
    for r in rows:
        groups["loop" if number(r[executed]) >= most / 2 else "rest"].append(r)
    got_by_group = {name: sum(number(r[samples]) for r in members) for name, members in groups.items()}
    total = sum(got_by_group.values())
    out: dict = {"source": str(path), "instructions": len(rows), "stall_samples": total}
    for name, members in groups.items():
        got = got_by_group[name]
        by_reason = {k.removeprefix("stall_"): sum(number(r[col[k]]) for r in members) for k in reasons}
        out[name] = {"instructions": len(members), "share_of_samples": round(got / total, 3),
                     "stalls": {k: round(v / got, 3) for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v > 0.005 * got}}
    opcodes = collections.Counter()
    for r in groups["loop"]:
        text = r[source].strip()
        text = text.split(None, 1)[1] if text.startswith("@") else text  # predicate
        opcodes[text.split()[0]] += 1
    out["loop"]["opcodes"] = dict(opcodes.most_common(12))
    loop_samples = got_by_group["loop"] or 1.0
    stalled = sorted(groups["loop"], key=lambda r: -number(r[samples]))[:5]
    out["loop"]["top"] = [{"source": r[source].strip(), "share_of_loop_samples": round(number(r[samples]) / loop_samples, 3),
                           "stall": max(reasons, key=lambda k: number(r[col[k]])).removeprefix("stall_")} for r in stalled]
    top = sorted(groups["rest"], key=lambda r: -number(r[samples]))[:3]
    out["rest"]["top"] = [{"source": r[source].strip(), "executed": number(r[executed]),
                           "share_of_samples": round(number(r[samples]) / total, 3)} for r in top]
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(json.dumps(summary(Path(sys.argv[1])), indent=1))
