"""End of turn: does a pause mid-sentence cut the turn, and how long does a finished one wait?

    python -m lab.turn_bench --json

Twenty spoken questions, made offline by the bundled Piper voice: ten said straight through, ten with a
pause of 0.4-0.7 s at a comma or after "and", "but" or "so" (Piper's own pause there, with the sentence's
intonation carried on, stretched to the length wanted). Each is fed in real time through one VoiceLoop per
mode: "silence" (300 ms of silence ends a turn) and "smart_turn" (the default: the end-of-turn model judges
each pause). Reported per mode: the paused questions cut into more than one turn, and the end-of-turn delay
(from the last voiced audio to the end of the turn) on the questions said straight through.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from engine.audio import SAMPLE_RATE
from voice.loop import RecordingSink, VoiceLoop, VoiceLoopConfig, feed_audio
from voice.options import EXIT_INTERRUPTED, report_failure
from voice.samples import piper_speech
from voice.trace import summarize
from voice.vad import VADConfig

COMPLETE = (
    "What is your name?",
    "How are you doing today?",
    "Can you tell me a joke?",
    "What is the capital of France?",
    "Do you like music?",
    "Tell me about the moon and the stars.",
    "What day is it today?",
    "Where do you live?",
    "I would like a cup of tea.",
    "Thank you, that was fun.",
)
# "|" marks the pause; the comma before it gives Piper's phrasing there.
PAUSED = (
    "My favourite colour is green, | what is yours?",
    "I went to the market this morning and, | bought some apples.",
    "I wanted to ask you something but, | I forgot what it was.",
    "It was raining all day so, | we stayed inside.",
    "When you have a moment, | could you tell me a joke?",
    "My sister lives in Paris and, | she loves it there.",
    "I tried to bake some bread, | but it did not rise.",
    "If it is sunny tomorrow, | shall we go for a walk?",
    "I have been learning the guitar and, | it is harder than I thought.",
    "The train was late so, | I missed the meeting.",
)
PAUSES_S = (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7)
MODES = ("silence", "smart_turn")
TARGET = {"cut_early": 0, "end_of_turn_delay_median_s": 0.25}


def paused_speech(text: str, pause_s: float, varied: bool = False) -> np.ndarray:
    """Piper's speech of text ("|" removed) with its longest inner silence, the phrase break at the mark,
    made pause_s long; varied as piper_speech's."""
    audio = piper_speech(text.replace("| ", "").replace("|", ""), varied=varied)
    frame = SAMPLE_RATE // 100
    count = audio.size // frame
    rms = np.sqrt((audio[: count * frame].reshape(count, frame) ** 2).mean(axis=1))
    quiet = rms < 0.03 * rms.max()
    voiced = np.flatnonzero(~quiet)
    runs, start = [], None
    for i in range(int(voiced[0]), int(voiced[-1]) + 1):
        if quiet[i] and start is None:
            start = i
        elif not quiet[i] and start is not None:
            runs.append((i - start, start, i))
            start = None
    if not runs:
        raise ValueError(f"no phrase break found in the speech of {text!r}")
    _, begin, end = max(runs)
    keep = frame  # 10 ms of the break's edges, so the words keep their fade
    return np.concatenate([audio[: begin * frame + keep], np.zeros(int(pause_s * SAMPLE_RATE), np.float32),
                           audio[end * frame - keep:]])


class _Silent:
    """An agent that says nothing: the bench times turns, not replies."""

    def stream_reply(self, user_text, history=(), cancelled=None):
        return iter(())


def run_mode(mode: str, questions: list[tuple[str, np.ndarray, bool]], check_words: bool = True,
             statement_delay: float | None = None) -> dict[str, Any]:
    config = VoiceLoopConfig(turn_detection=mode, vad=VADConfig(min_silence_ms=300), check_words=check_words)
    if statement_delay is not None:
        config = replace(config, statement_endpointing_delay=statement_delay)
    loop = VoiceLoop(RecordingSink(), agent=_Silent(), config=config)
    rows = []
    try:
        loop.asr.warm_up()
        clock = None
        for text, audio, paused in questions:
            before = len(loop.trace.turns)
            framed = np.concatenate([np.zeros(int(0.6 * SAMPLE_RATE), np.float32), audio,
                                     np.zeros(int(2.4 * SAMPLE_RATE), np.float32)])
            clock = feed_audio(loop, framed, real_time=True, clock=clock)
            loop.wait_idle(10)
            turns = [t for t in loop.trace.turns[before:] if "speech_end" in t.stamps]
            answered = [t for t in turns if t.info.get("status") != "continued"]
            row: dict[str, Any] = {"question": text, "paused": paused, "turns": len(turns),
                                   "cut_early": len(turns) > 1 or not turns,
                                   "transcript": answered[-1].info.get("user_text", "") if answered else ""}
            if turns:
                last = turns[-1]
                row["end_of_turn_delay_s"] = round(last.stamps["speech_end"] - last.stamps["last_voiced_audio"], 4)
                row["end_reason"] = last.info.get("end_reason")
                if "turn_judgements" in last.info:
                    row["turn_judgements"] = last.info["turn_judgements"]
            rows.append(row)
    finally:
        loop.close()
    paused_rows = [r for r in rows if r["paused"]]
    straight = [r for r in rows if not r["paused"]]
    delays = summarize([r["end_of_turn_delay_s"] for r in straight if "end_of_turn_delay_s" in r])
    cut = sum(r["cut_early"] for r in paused_rows)
    return {
        "mode": mode,
        **({"check_words": check_words, "statement_endpointing_delay": config.statement_endpointing_delay}
           if mode == "smart_turn" else {}),
        "cut_early": cut,
        "cut_early_straight": sum(r["cut_early"] for r in straight),
        "paused_questions": len(paused_rows),
        "end_of_turn_delay_s": delays,
        # questions end at min_endpointing_delay, other complete turns at statement_endpointing_delay
        "end_of_turn_delay_questions_s": summarize([r["end_of_turn_delay_s"] for r in straight
                                                    if r["question"].endswith("?") and "end_of_turn_delay_s" in r]),
        "end_of_turn_delay_statements_s": summarize([r["end_of_turn_delay_s"] for r in straight
                                                     if not r["question"].endswith("?") and "end_of_turn_delay_s" in r]),
        "met": cut <= TARGET["cut_early"] and delays.get("median", 1e9) <= TARGET["end_of_turn_delay_median_s"],
        "questions": rows,
    }


def run_bench(modes: tuple[str, ...], check_words: bool = True, statement_delay: float | None = None) -> dict[str, Any]:
    questions = [(q, piper_speech(q, varied=True), False) for q in COMPLETE]
    questions += [(q, paused_speech(q, PAUSES_S[i % len(PAUSES_S)], varied=True), True) for i, q in enumerate(PAUSED)]
    order = [questions[i // 2 + (i % 2) * len(COMPLETE)] for i in range(len(questions))]  # alternate the two sets
    load_before = os.getloadavg()
    results = [run_mode(mode, order, check_words, statement_delay) for mode in modes]
    return {
        "benchmark": "end of turn: paused questions cut early, end-of-turn delay on questions said straight through",
        "speech_source": "piper",
        "pauses_s": list(PAUSES_S),
        "feed": "real time, 32 ms chunks; 0.6 s of silence before each question, 2.4 s after",
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "target": TARGET,
        "modes": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.turn_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mode", choices=MODES, action="append", help="a mode to run (default: both)")
    parser.add_argument("--statement-endpointing-delay", type=float, default=None,
                        help="smart_turn: silence that ends a complete turn whose words are not a question (default: the loop's)")
    parser.add_argument("--no-check-words", dest="check_words", action="store_false",
                        help="smart_turn on the model's verdict alone (the loop's check_words off)")
    args = parser.parse_args(argv)
    try:
        report = run_bench(tuple(args.mode or MODES), args.check_words, args.statement_endpointing_delay)
    except KeyboardInterrupt:
        return report_failure("interrupted", args.json, EXIT_INTERRUPTED)
    except (ValueError, OSError, RuntimeError) as err:
        return report_failure(f"{type(err).__name__}: {err}", args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for mode in report["modes"]:
            for r in mode["questions"]:
                print(f"{mode['mode']:10s} {'paused' if r['paused'] else 'straight':8s} turns {r['turns']} "
                      f"delay {r.get('end_of_turn_delay_s')} {r.get('end_reason')} {r['question']!r} -> {r['transcript']!r}")
            d = mode["end_of_turn_delay_s"]
            print(f"{mode['mode']}: cut early {mode['cut_early']}/{mode['paused_questions']}, end-of-turn delay median "
                  f"{d.get('median')} s, p95 {d.get('p95')} s; target met: {mode['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
