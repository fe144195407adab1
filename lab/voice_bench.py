"""Per-stage latency of the voice loop over several spoken questions.

    python -m lab.voice_bench --json

Each question (spoken by piper, or espeak-ng with --speech espeak) is framed by
silence and fed through one VoiceLoop in 32 ms chunks at wall-clock pace, as a
microphone would deliver it: each chunk is fed when its last sample would have
been captured. "End of speech" is the moment the last voiced chunk was fed, so
the silence wait that decides the end of the turn is counted
(end_of_turn_delay). Between questions the stream carries on with silence
until the reply has finished playing, as in a real conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from typing import Any

import numpy as np

from engine.audio import SAMPLE_RATE
from voice.loop import RecordingSink, feed_audio
from voice.options import EXIT_INTERRUPTED, add_loop_args, build_loop, report_failure
from voice.samples import espeak_speech, piper_speech
from voice.trace import summarize

QUESTIONS = (
    "Hello, how are you doing today?",
    "What is your name?",
    "What time is it right now?",
    "Tell me about the moon and the stars.",
    "Can you tell me a joke about computers?",
    "My favourite colour is green, what is yours?",
    "What day is it today?",
    "I would like to talk about my holiday plans.",
    "Do you like music?",
    "Thank you, that was fun.",
)
STAGES = ("end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "speech_end_to_first_audio", "e2e_latency")
TARGET_S = {"cpu": 1.3, "cuda": 0.6}  # median e2e_latency, with the local language model


def word_error_rate(reference: str, hypothesis: str) -> float:
    norm = lambda s: re.sub(r"[^a-z0-9' ]+", " ", s.lower().replace("favourite", "favorite").replace("colour", "color")).split()  # noqa: E731
    ref, hyp = norm(reference), norm(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    questions = QUESTIONS[: args.utterances]
    speech = [espeak_speech(q) if args.speech == "espeak" else piper_speech(q, varied=True) for q in questions]
    sink = RecordingSink()
    loop = build_loop(args, sink)
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        loop.asr.warm_up()
        loop.tts.warm_up()
        prepare = getattr(getattr(loop, "agent", None), "prepare", None)
        if prepare is not None:  # the system prompt read, as an app does once at start
            prepare([])
        clock = None
        silence = np.zeros(SAMPLE_RATE * 32 // 1000, np.float32)
        for question, audio in zip(questions, speech):
            turns_before = len(loop.trace.turns)
            lead = np.zeros(int(0.6 * SAMPLE_RATE), np.float32)
            clock = feed_audio(loop, np.concatenate([lead, audio]), real_time=True, clock=clock)
            # Keep the microphone stream going until the reply is answered and played out.
            deadline = clock + args.turn_timeout
            while clock < deadline:
                clock = feed_audio(loop, silence, real_time=True, clock=clock)
                turns = loop.trace.turns[turns_before:]
                if turns and all(t.written for t in turns) and not loop.is_speaking:
                    break
            turn = next((t for t in reversed(loop.trace.turns[turns_before:]) if t.info.get("user_text")), None)
            if turn is None:
                # Not one word heard: as wrong as a transcript can be.
                results.append({"question": question, "transcript": "", "wer": 1.0, "error": "no transcript"})
                continue
            results.append(
                {
                    "question": question,
                    "transcript": turn.info.get("user_text", ""),
                    "wer": round(word_error_rate(question, turn.info.get("user_text", "")), 3),
                    "reply": turn.info.get("reply_text", ""),
                    "status": turn.info.get("status"),
                    "durations_s": turn.durations(),
                    "reply_gap_s": turn.info.get("reply_gap_s", 0.0),
                }
            )
    finally:
        loop.close()
    device = loop.asr.device
    return {
        "benchmark": "voice loop, end of speech -> first reply audio",
        "feed": "real time: 32 ms chunks, each fed when its last sample would have been captured",
        "end_of_speech": "when the last voiced chunk was fed (so e2e_latency includes end_of_turn_delay)",
        "speech_source": args.speech,
        "device": device,
        "asr_compute_type": loop.asr.compute_type,
        "agent": args.agent,
        "agent_model": getattr(getattr(loop, "agent", None), "describe", lambda: None)(),
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "config": {
            "threshold": args.threshold,
            "min_silence_ms": args.min_silence_ms,
            "speech_pad_ms": args.speech_pad_ms,
            "partial_interval_s": loop.config.partial_interval_s,
            "output_sample_rate": args.sample_rate,
        },
        "utterances": results,
        **score(results, TARGET_S[device]),
    }


def answered(result: dict[str, Any]) -> bool:
    """A question whose reply was completed and reached the speaker."""
    return result.get("status") == "completed" and "e2e_latency" in result.get("durations_s", {})


def score(results: list[dict[str, Any]], limit_s: float) -> dict[str, Any]:
    """Word error rate, stage latencies and the latency target over the questions asked.

    A question not heard counts as a word error rate of 1.0, and the target is met only when every question
    was answered: latencies of the few turns that worked say nothing about the ones that did not."""
    stages = {name: summarize([r["durations_s"][name] for r in results if name in r.get("durations_s", {})]) for name in STAGES}
    median = stages["e2e_latency"].get("median")
    count = sum(answered(r) for r in results)
    return {
        "questions": len(results),
        "answered": count,
        "mean_wer": round(float(np.mean([r["wer"] for r in results])), 3) if results else None,
        "stages_s": stages,
        # the longest silence inside each reply's voice, where its next words were not ready in time
        "reply_gap_s": summarize([r["reply_gap_s"] for r in results if answered(r)]),
        "target": {
            "metric": "e2e_latency median",
            "limit_s": limit_s,
            "median_s": median,
            "every_question_answered": count == len(results),
            "met": bool(results) and count == len(results) and median is not None and median <= limit_s,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.voice_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--utterances", type=int, default=8, help=f"how many questions (at most {len(QUESTIONS)})")
    parser.add_argument("--speech", choices=("piper", "espeak"), default="piper", help="what speaks the questions")
    parser.add_argument("--turn-timeout", type=float, default=20.0, help="seconds to wait for one reply")
    add_loop_args(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.utterances <= len(QUESTIONS):
        parser.error(f"--utterances must be between 1 and {len(QUESTIONS)}")
    try:
        report = run_bench(args)
    except KeyboardInterrupt:
        return report_failure("interrupted", args.json, EXIT_INTERRUPTED)
    except (ValueError, OSError, RuntimeError) as err:
        return report_failure(f"{type(err).__name__}: {err}", args.json)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["utterances"]:
            print(f"{r['question']!r} -> {r.get('transcript')!r}: {r.get('durations_s')}")
        for name, s in report["stages_s"].items():
            print(f"{name:28s} median {s.get('median', float('nan')) * 1000:6.0f} ms   p95 {s.get('p95', float('nan')) * 1000:6.0f} ms   (n={s['n']})")
        print(f"answered {report['answered']}/{report['questions']}, mean word error rate {report['mean_wer']}")
        print(f"target {report['target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
