"""Speech recognition's shorter windows against Whisper's own 30 s, on Piper-spoken questions.

    python -m lab.asr_window --json

`WhisperASR.transcribe` runs the encoder over 10 or 15 s instead of 30 s. This measures, per window, the
decode time and whether it hears the same words as the 30 s decode (`transcribe_full`), on the voice, turn
and agent benches' questions. Then the turns a partial transcript sees: every question cut at each 0.15 s
from 0.4 s on, with no silence before or after, as the voice loop slices them; a transcript that says a
phrase twice when the question does not ("Hello? Hello?") counts as a repeat; the opening question, "Hello,
how are you doing today?", is cut so in 20 renderings. Last, silence and noise, which should give no words. Each decode is made twice on the same audio: as served (the window filled with silent
audio, the no-speech check) and from log-mel features padded with zeros without the check, as before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

import numpy as np

from lab.agent_bench import CONVERSATIONS
from lab.turn_bench import COMPLETE, PAUSED
from lab.voice_bench import QUESTIONS
from voice.asr import HOP, SAMPLE_RATE, WhisperASR
from voice.samples import piper_speech

REPEAT = re.compile(r"\b(\w+(?:\W+\w+){0,3})\W+\1\b", re.I)
CUT_STEP_S = 0.15
FIRST_CUT_S = 0.4
OPENING = "Hello, how are you doing today?"
OPENING_RENDERINGS = 20
OPENING_CUTS_S = (0.4, 0.5, 0.6, 0.7, 0.8)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def questions() -> list[str]:
    said = [*QUESTIONS, *COMPLETE, *(p.replace(" | ", " ") for p in PAUSED), *(t.said for c in CONVERSATIONS for t in c)]
    return list(dict.fromkeys(said))


def decode_window(asr: WhisperASR, audio: np.ndarray, window_s: int, pad: str) -> str:
    """The decode over window_s: as served (`transcribe_window`) with pad "audio"; with "features", from log-mel
    features padded with zeros and without the no-speech check, as it was served before."""
    if pad == "audio":
        return asr.transcribe_window(audio, window_s)
    frames = window_s * SAMPLE_RATE // HOP
    features = asr.log_mel(audio)
    features = np.pad(features, ((0, 0), (0, max(0, frames - features.shape[1]))))[:, :frames]
    return asr.decode(features, audio.size / SAMPLE_RATE)[0]


def timed(fn, *args) -> tuple[str, float]:
    start = time.perf_counter()
    text = fn(*args)
    return text, time.perf_counter() - start


PADS = ("audio", "features")


def run(limit: int | None) -> dict:
    """Every decode twice, on the same rendering: the window filled with silent audio (as served) and with zeros."""
    asr = WhisperASR(device="cpu")
    asr.transcribe(np.zeros(SAMPLE_RATE, np.float32))  # warm
    said = questions()[:limit]
    silence = np.zeros(int(0.3 * SAMPLE_RATE), np.float32)
    windows = {(pad, w): {"seconds": [], "same_words": 0, "differ": []} for pad in PADS for w in asr.windows_s}
    full_seconds: list[float] = []
    cuts = {pad: {"decodes": 0, "repeated": []} for pad in PADS}
    for text in said:
        speech = piper_speech(text, varied=True)
        audio = np.concatenate([silence, speech, silence])
        full, seconds = timed(asr.transcribe_full, audio)
        full_seconds.append(seconds)
        for (pad, window), row in windows.items():
            heard, seconds = timed(decode_window, asr, audio, window, pad)
            row["seconds"].append(seconds)
            if words(heard) == words(full):
                row["same_words"] += 1
            else:
                row["differ"].append({"said": text, "window": heard, "full": full})
        for end in np.arange(FIRST_CUT_S, speech.size / SAMPLE_RATE + 1e-6, CUT_STEP_S):
            cut = speech[: int(end * SAMPLE_RATE)]
            for pad in PADS:
                heard = decode_window(asr, cut, min(asr.windows_s), pad)
                cuts[pad]["decodes"] += 1
                if REPEAT.search(heard) and not REPEAT.search(text):
                    cuts[pad]["repeated"].append({"said": text, "cut_s": round(float(end), 2), "heard": heard})
    # The question that opens most conversations, in several renderings (Piper's speech varies from call to call)
    opening = {pad: [] for pad in PADS}
    for _ in range(OPENING_RENDERINGS):
        hello = piper_speech(OPENING, varied=True)
        for end in OPENING_CUTS_S:
            for pad in PADS:
                opening[pad].append(decode_window(asr, hello[: int(end * SAMPLE_RATE)], min(asr.windows_s), pad))
    rng = np.random.default_rng(0)
    no_speech = {"silence 1 s": np.zeros(SAMPLE_RATE, np.float32)}
    no_speech |= {f"white noise rms {rms:g}, 2 s": rng.normal(0, rms, 2 * SAMPLE_RATE).astype(np.float32)
                  for rms in (0.001, 0.01, 0.03)}
    p95 = lambda xs: sorted(xs)[int(0.95 * (len(xs) - 1))]  # noqa: E731
    per_pad = {pad: {
        "windows": {str(w): {"decode_median_s": round(statistics.median(r["seconds"]), 3),
                             "decode_p95_s": round(p95(r["seconds"]), 3), "same_words_as_full": r["same_words"],
                             "differ": r["differ"]} for (p, w), r in windows.items() if p == pad},
        "cut_turns": {"window_s": min(asr.windows_s), "decodes": cuts[pad]["decodes"],
                      "repeats": len(cuts[pad]["repeated"]), "repeated": cuts[pad]["repeated"]},
        "opening": {"decodes": len(opening[pad]), "repeats": sum(bool(REPEAT.search(t)) for t in opening[pad]),
                    "heard": opening[pad]},
        "no_speech": {name: decode_window(asr, audio, min(asr.windows_s), pad) for name, audio in no_speech.items()},
    } for pad in PADS}
    return {
        "benchmark": "speech recognition: shorter windows against the 30 s decode",
        "model": asr.model_name, "questions": len(said), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"), "opening": {"said": OPENING, "renderings": OPENING_RENDERINGS,
                                                     "cuts_s": list(OPENING_CUTS_S)},
        "full": {"decode_median_s": round(statistics.median(full_seconds), 3), "decode_p95_s": round(p95(full_seconds), 3)},
        "served": per_pad["audio"], "zero_features": per_pad["features"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.asr_window", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=None, help="only the first N questions")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    report = run(args.questions)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print(f"30 s: decode median {report['full']['decode_median_s']} s")
    for name in ("served", "zero_features"):
        r = report[name]
        for w, row in r["windows"].items():
            print(f"{name}, {w} s window: decode median {row['decode_median_s']} s, p95 {row['decode_p95_s']} s, "
                  f"same words as 30 s: {row['same_words_as_full']} of {report['questions']}")
        print(f"{name}: cut turns said twice {r['cut_turns']['repeats']} of {r['cut_turns']['decodes']}; the opening "
              f"{r['opening']['repeats']} of {r['opening']['decodes']}; no speech: {r['no_speech']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
