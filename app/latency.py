"""The latency panel: each turn cut into the stages between its trace stamps, as a table
and a stacked bar chart, with median and p95 over the session."""

from __future__ import annotations

import html
from typing import Any

from voice.trace import summarize

# (key, label, from stamp, to stamp): consecutive, so the stages add up to the total.
STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("end_of_turn", "end-of-turn detection", "last_voiced_audio", "speech_end"),
    ("asr", "speech recognition", "speech_end", "asr_done"),
    ("reply_text", "reply first text", "asr_done", "reply_first_text"),
    ("tts_audio", "speech first audio", "reply_first_text", "tts_first_audio"),
    ("speaking_frame", "first speaking frame", "tts_first_audio", "first_speaking_frame"),
    ("delivered", "delivered to the browser", "first_speaking_frame", "client_delivered"),
)
TOTAL = ("total", "end of speech to voice at the browser", "last_voiced_audio", "client_delivered")
COLOURS = ("#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3", "#a6d854", "#ffd92f")


def turn_stages(record: dict[str, Any]) -> dict[str, float]:
    """Seconds per stage (and total) for one turn record; stages whose stamps are missing are left out. A stage
    done before the one ahead of it ended (a reply begun at the user's pause has its first text before the turn
    ends) counts 0, and the next one starts where that one ended: the stages still add up to the total."""
    stamps = record.get("stamps", {})
    out = {}
    reached: float | None = None  # where the stages so far ended
    for key, _, start, end in STAGES:
        if start in stamps and end in stamps:
            begin = stamps[start] if reached is None else max(stamps[start], reached)
            reached = max(stamps[end], begin)
            out[key] = reached - begin
    key, _, start, end = TOTAL
    if start in stamps and end in stamps:
        out[key] = stamps[end] - stamps[start]
    return out


def answered(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns that got a reply (ignored noise and cancelled turns have no latency to show)."""
    return [r for r in records if "tts_first_audio" in r.get("stamps", {})]


def session_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Median and p95 of each stage and of the total over the answered turns."""
    rows = [turn_stages(r) for r in answered(records)]
    return {key: summarize([row[key] for row in rows if key in row]) for key, *_ in (*STAGES, TOTAL)}


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{1000 * value:.0f}"


def render_panel(records: list[dict[str, Any]]) -> str:
    """HTML: per-turn table, stacked bars, median and p95 rows."""
    turns = answered(records)
    if not turns:
        return '<div id="tl-latency" class="tl-latency"><p class="tl-empty">No answered turn yet.</p></div>'
    head = "".join(f"<th>{html.escape(label)} (ms)</th>" for _, label, *_ in STAGES)
    rows = []
    for record in turns:
        stages = turn_stages(record)
        cells = "".join(f'<td data-stage="{key}">{_ms(stages.get(key))}</td>' for key, *_ in STAGES)
        said = html.escape(str(record.get("user_text", ""))[:60])
        rows.append(f'<tr class="tl-turn" data-turn="{record["turn_id"]}"><td>{record["turn_id"]}</td><td>{said}</td>'
                    f'{cells}<td data-stage="total">{_ms(stages.get("total"))}</td></tr>')
    summary = session_summary(records)
    for stat in ("median", "p95"):
        cells = "".join(f'<td data-stage="{key}">{_ms(summary[key].get(stat))}</td>' for key, *_ in (*STAGES, TOTAL))
        rows.append(f'<tr class="tl-stat" data-stat="{stat}"><td colspan="2">{stat}</td>{cells}</tr>')
    table = (f'<table class="tl-table"><thead><tr><th>turn</th><th>you said</th>{head}<th>total (ms)</th></tr></thead>'
             f'<tbody>{"".join(rows)}</tbody></table>')
    return f'<div id="tl-latency" class="tl-latency">{table}{render_bars(turns)}</div>'


def render_bars(turns: list[dict[str, Any]]) -> str:
    """One horizontal stacked bar per turn, widths to a common scale."""
    per_turn = [(r["turn_id"], turn_stages(r)) for r in turns]
    longest = max((sum(max(s.get(k, 0.0), 0.0) for k, *_ in STAGES) for _, s in per_turn), default=0.0) or 1.0
    legend = "".join(f'<span class="tl-key"><i style="background:{c}"></i>{html.escape(label)}</span>'
                     for (_, label, *_), c in zip(STAGES, COLOURS))
    bars = []
    for turn_id, stages in per_turn:
        parts = "".join(
            f'<span class="tl-seg" title="{html.escape(label)}: {_ms(stages[key])} ms" '
            f'style="width:{100 * max(stages[key], 0.0) / longest:.2f}%;background:{colour}"></span>'
            for (key, label, *_), colour in zip(STAGES, COLOURS) if key in stages)
        bars.append(f'<div class="tl-bar-row"><span class="tl-bar-label">turn {turn_id}</span>'
                    f'<span class="tl-bar">{parts}</span><span class="tl-bar-total">{_ms(stages.get("total"))} ms</span></div>')
    return f'<div class="tl-chart"><div class="tl-legend">{legend}</div>{"".join(bars)}</div>'
