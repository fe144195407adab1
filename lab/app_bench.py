"""End of the user's speech to the character's voice at the browser, over several turns.

    python -m lab.app_bench --json                 # the app's spec (auto), default agent, this machine's device
    python -m lab.app_bench --spec tiny --json     # the small engine CI uses on 2 CPU cores

The whole app runs: its web server in this process, Debian's chromium driven by Playwright
with a WAV of spoken questions as its microphone (each followed by silence for the reply),
the real engine and the real voice loop. Delivery is the browser's own report: the first
onset of the character's voice it played, on this process's clock through the data
channel's clock sync. Prints the per-turn stages and their median and p95, and what the
microphone brought the voice loop: its peak level and how much of each question was heard
(the browser's processing of it is the app's mic_* settings; --noise-rms puts noise under the questions).

With --barge-ins N, a second session follows with a microphone the page plays into at chosen moments: N times a
question, and while its reply's voice plays in the page, the user cuts in. Reported: from the first sample of the
user's speech to the last loud sample of the character's voice in the page, and when the voice loop cut the reply.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from app.latency import STAGES, TOTAL, session_summary, turn_stages

TARGET_S = 0.9  # median, one GPU, demo spec, default agent (the local language model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def delivered_turns(live) -> list[dict[str, Any]]:
    return [r for r in live.turn_records() if "client_delivered" in r["stamps"] and r.get("user_text")]


def undelivered_turns(all_records: list[dict[str, Any]], delivered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns not timed, with their status: e.g. a question the end-of-turn detector split at a pause
    leaves a first half whose reply the second half interrupted."""
    delivered_ids = {r["turn_id"] for r in delivered}
    return [{"turn": r["turn_id"], "transcript": r.get("user_text", ""), "status": r.get("status", "unfinished")}
            for r in all_records if r["turn_id"] not in delivered_ids]


def word_recall(questions: list[str], transcripts: list[str]) -> float:
    """Mean over the questions of the share of a question's words in the transcript that holds most of them:
    1.0 when every question was heard whole, less for a first or last word cut off."""
    def words(text: str) -> list[str]:
        return re.findall(r"[a-z0-9']+", text.lower())

    shares = []
    for question in questions:
        asked = words(question)
        heard = [set(words(t)) for t in transcripts] or [set()]
        shares.append(max(sum(w in h for w in asked) for h in heard) / len(asked))
    return sum(shares) / len(shares)


def concealed_share(page) -> dict[str, Any]:
    """The character's audio as the browser received it: samples received, and those it made up for gaps."""
    from lab.browser import voice_received

    got = voice_received(page)
    if not got or not got["received"]:
        return {"received_samples": 0, "concealed_share": None}
    return {"received_samples": got["received"], "concealed_share": round(got["concealed"] / got["received"], 4)}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The report; the questions' WAV and the session log live in a folder removed at the end."""
    with tempfile.TemporaryDirectory(prefix="talkloop-bench-") as tmp:
        return _run_bench(args, Path(tmp))


def _run_bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from lab.browser import chromium_path, conversation_wav, start_in_browser, start_server, stop_server
    from app.config import build_config
    from app.controller import Controller
    from lab.voice_bench import QUESTIONS
    from voice.samples import piper_speech, sample_speech

    config = build_config(args.config, dict(spec=args.spec, device=args.device, port=free_port(), record=False,
                                            session_log=str(tmp / "sessions.jsonl")))
    questions = QUESTIONS[: args.utterances]
    wav = conversation_wav(tmp / "questions.wav", [piper_speech(q, varied=True) if args.voice == "piper" else sample_speech(q) for q in questions], gap_s=args.gap_s,
                           noise_rms=args.noise_rms)
    controller = Controller(config)
    if controller.failures():
        raise RuntimeError("; ".join(controller.failures()))
    server, thread = start_server(controller)
    load_before = os.getloadavg()
    try:
        with sync_playwright() as p:
            browser, page = start_in_browser(p, wav, config.port)
            browser_name = f"{chromium_path()} {browser.version}"
            deadline = time.monotonic() + args.utterances * (args.gap_s + 6.0) + 120.0
            while time.monotonic() < deadline:
                live = controller.live
                if live is not None and len(delivered_turns(live)) >= args.utterances:
                    break
                if controller.failures():
                    raise RuntimeError("; ".join(controller.failures()))
                time.sleep(0.5)
            if args.screenshot:
                time.sleep(1.0)  # one more panel refresh
                page.screenshot(path=args.screenshot, full_page=True)
            voice_at_browser = concealed_share(page)
            browser.close()
        live = controller.live
        health = controller.health()
        controller.stop()
        engine_stats = live.stats if live is not None and live.stats is not None else {}
        barge_ins = _barge_ins(controller, args.barge_ins) if args.barge_ins else None
    finally:
        controller.close()
        stop_server(server, thread)
    records = delivered_turns(live) if live is not None else []
    heard = [r.get("user_text", "") for r in live.turn_records()] if live is not None else []
    undelivered = undelivered_turns(live.turn_records(), records) if live is not None else []
    turns = [{"turn": r["turn_id"], "transcript": r.get("user_text", ""), "reply": r.get("reply_text", ""),
              "stages_ms": {k: round(1000 * v, 1) for k, v in turn_stages(r).items()}} for r in records]
    summary = session_summary(records)
    total = summary[TOTAL[0]]
    return {
        "benchmark": "app: end of user speech -> character's voice played in the browser",
        "end_of_speech": "last voiced microphone chunk fed to the voice loop (so end-of-turn detection is counted)",
        "delivered": "first onset of the character's voice played by the browser, reported over the data channel",
        "questions_voice": args.voice,
        "spec": health.get("spec", config.spec), **({"spec_choice": health["spec_choice"]} if "spec_choice" in health else {}),
        "device": health.get("device"), "placement": health.get("placement"),
        "weights": health.get("weights"), "agent": config.agent, "replies": health.get("replies"), "browser": browser_name,
        "engine": {**{k: health.get(k) for k in ("fps", "step_ms_p50", "step_ms_p95", "underruns", "buffer_depth", "lead",
                                                 "av_offset_ms")},
                   "video_fps": round(engine_stats.get("video_fps", 0.0), 2), "frames_held": engine_stats.get("frames_held", 0),
                   "real_time": health.get("real_time")},
        "voice_at_the_browser": voice_at_browser,
        "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "microphone": {"constraints": config.microphone_constraints(), "peak": round(live.mic_peak, 3) if live else None,
                       "word_recall": round(word_recall(list(questions), heard), 3)},
        "utterances_asked": len(questions), "turns_measured": len(records),
        "turns": turns, "turns_not_delivered": undelivered,
        "stages_s": {label: summary[key] for key, label, *_ in (*STAGES, TOTAL)},
        **({"barge_in": barge_ins} if barge_ins is not None else {}),
        "target": {"metric": "end of speech -> voice at the browser, median", "limit_s": TARGET_S,
                   "applies_to": "one GPU, demo spec, default agent", "median_s": total.get("median"),
                   "p95_s": total.get("p95"), "met": total.get("median") is not None and total["median"] <= TARGET_S},
    }


BARGE_IN_QUESTION = "Tell me a story about the moon and the stars."  # a story: up to six sentences
BARGE_IN_WORDS = "Wait, I have another question."


def _barge_ins(controller, count: int) -> dict[str, Any]:
    """A session with the scripted microphone: `count` questions, each cut short while its reply plays."""
    from playwright.sync_api import sync_playwright

    from lab.browser import SCRIPTED_MIC, barge_in, start_in_browser, wait_until
    from voice.samples import piper_speech
    from voice.trace import summarize

    question, words = piper_speech(BARGE_IN_QUESTION, varied=True), piper_speech(BARGE_IN_WORDS, varied=True)
    rows = []
    with sync_playwright() as p:
        browser, page = start_in_browser(p, None, controller.config.port,
                                         before_load=lambda page: page.add_init_script(SCRIPTED_MIC))
        wait_until(lambda: page.evaluate("() => window.scriptedMic.watchVoice()"), 60, "the character's voice track")
        for _ in range(count):
            result = barge_in(page, controller.live, question, words)
            cut = result.pop("turn")
            rows.append({**result, "status": cut.get("status"), "heard_text": cut.get("heard_text"),
                         "reply_text": cut.get("reply_text")})
            time.sleep(6.0)  # the reply to the interjection
        browser.close()
    controller.stop()
    measured = [r for r in rows if r["voice_playing_when_user_spoke"] and r["status"] == "interrupted"]
    return {"measured": "page: the user's first sample of speech -> the character's last loud sample heard (5 ms ticks; "
                        "voice_received: loud in the stream, muted or not); server: the voice loop's barge_in stamp, "
                        "on the same wall clock",
            "asked": count, "cut": len(measured),
            "voice_stopped_s": summarize([r["voice_stopped_ms"] / 1000 for r in measured]),
            "voice_received_s": summarize([r["voice_received_ms"] / 1000 for r in measured]),
            "detected_s": summarize([r["detected_ms"] / 1000 for r in measured if r["detected_ms"] is not None]),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.app_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--spec", default=None, help="engine spec (default: the app's, auto)")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"))
    p.add_argument("--config", default=None, help="YAML settings for the app (agent, VAD, placement...)")
    p.add_argument("--utterances", type=int, default=5, help="turns to measure (at most 10)")
    p.add_argument("--gap-s", type=float, default=9.0, help="silence after each question, for the reply")
    p.add_argument("--voice", default="piper", choices=("piper", "espeak"),
                   help="who asks: the Piper voice (as the voice and turn benches) or espeak-ng (whose speech the "
                        "end-of-turn model often finds unfinished)")
    p.add_argument("--noise-rms", type=float, default=0.0, help="white noise of this level under the questions "
                   "(the microphone's noise suppression: mic_noise_suppression)")
    p.add_argument("--barge-ins", type=int, default=0, help="then this many barge-ins, measured in the page")
    p.add_argument("--screenshot", default=None, help="save the page as a PNG at the end")
    args = p.parse_args(argv)
    if not 1 <= args.utterances <= 10:
        p.error("--utterances must be between 1 and 10")
    try:
        report = run_bench(args)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for turn in report["turns"]:
            print(f"turn {turn['turn']}: {turn['transcript']!r} {turn['stages_ms']}")
        for name, s in report["stages_s"].items():
            print(f"{name:40s} median {s.get('median', float('nan')) * 1000:7.0f} ms  p95 {s.get('p95', float('nan')) * 1000:7.0f} ms  (n={s['n']})")
        print(f"target {report['target']}")
        if "barge_in" in report:
            b = report["barge_in"]
            print(f"barge-in ({b['cut']} of {b['asked']}): voice stopped in the page after median "
                  f"{b['voice_stopped_s'].get('median')} s (p95 {b['voice_stopped_s'].get('p95')}), loop cut it after "
                  f"{b['detected_s'].get('median')} s")
    return 0 if report["turns_measured"] else 1


if __name__ == "__main__":
    sys.exit(main())
