"""Write speech in the app's own Piper voice as a 16 kHz WAV: the held-out evaluation speech (not in the training
corpus), or the given lines.

    python -m lab.eval_speech data/eval.wav
    python -m lab.eval_speech assets/hello.wav --text "Hello there! It's lovely to meet you." --text "What shall we talk about?"

Deterministic (piper with its sampling noise off), so the lip-sync figures in docs/ can be rerun and the
shipped greeting (assets/hello.wav, what `python -m engine.generate` says when given no --audio) remade.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE, write_wav
from training.train import PiperSource

SENTENCES = [
    "Hello there! I'm glad you came by today. Let me tell you about the little garden behind my house.",
    "Every morning the birds wake me up, and I sit outside with a cup of tea, watching the light move across the wall.",
    "Do you have a favourite place like that? Somewhere quiet, where time seems to slow down a bit?",
]


def write_speech(out: Path, sentences: list[str]) -> float:
    """The sentences, each followed by half a second of silence, as a 16-bit WAV; returns its seconds."""
    voice = PiperSource()
    pause = np.zeros(SAMPLE_RATE // 2, np.float32)
    pcm = np.concatenate([part for s in sentences for part in (voice.say(s, 1.0), pause)])
    write_wav(out, pcm, SAMPLE_RATE)
    return pcm.size / SAMPLE_RATE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.eval_speech", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="data/eval.wav", help="the WAV to write (its folder is made)")
    parser.add_argument("--text", action="append", help="a line to say instead of the evaluation speech (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.is_dir():
        parser.error(f"{out} is a folder: give the WAV file to write, e.g. {out / 'eval.wav'}")
    if args.text is not None and not all(t.strip() for t in args.text):
        parser.error("--text needs words to say")
    try:
        seconds = write_speech(out, args.text or SENTENCES)
    except OSError as e:
        print(f"error: writing {out}: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
