"""Write the held-out evaluation speech (piper's voice, not in the training corpus) as a 16 kHz WAV.

    python tools/eval_speech.py data/eval.wav

Deterministic (piper with its sampling noise off), so the lip-sync figures in docs/ can be rerun.
"""

from __future__ import annotations

import sys
import wave

import numpy as np

from engine.audio import SAMPLE_RATE
from engine.train import PiperSource

SENTENCES = [
    "Hello there! I'm glad you came by today. Let me tell you about the little garden behind my house.",
    "Every morning the birds wake me up, and I sit outside with a cup of tea, watching the light move across the wall.",
    "Do you have a favourite place like that? Somewhere quiet, where time seems to slow down a bit?",
]


def main(out: str) -> None:
    voice = PiperSource()
    pause = np.zeros(SAMPLE_RATE // 2, np.float32)
    pcm = np.concatenate([part for s in SENTENCES for part in (voice.say(s, 1.0), pause)])
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes())
    print(f"{out}: {pcm.size / SAMPLE_RATE:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/eval.wav")
