"""Speech made offline for tests and benchmarks: espeak-ng (Debian) or piper itself."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE, read_wav, to_mono_float32


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def espeak_speech(text: str, voice: str = "en-us", words_per_minute: int = 165) -> np.ndarray:
    """16 kHz mono float32 speech of text from the espeak-ng command."""
    if not espeak_available():
        raise RuntimeError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(words_per_minute), "-w", str(path), text], check=True, capture_output=True, timeout=60)
        samples, rate = read_wav(path)
    return to_mono_float32(samples, rate)


def piper_speech(text: str, length_scale: float | None = None, varied: bool = False) -> np.ndarray:
    """16 kHz mono float32 speech of text from the bundled piper voice.

    varied=False renders without Piper's sampling noise, so a text gives the same samples on every call and a test
    that hears it passes or fails the same way each run; vary such speech with length_scale. varied=True samples
    the noise as the app's voice does (different on every call), for benches that measure over that variety."""
    from .tts import PiperTTS

    tts = PiperTTS(length_scale=length_scale, noise=varied)
    return to_mono_float32(tts.synthesize_all(text), tts.sample_rate)


@functools.lru_cache(maxsize=64)
def _cached_speech(text: str) -> np.ndarray:
    return espeak_speech(text) if espeak_available() else piper_speech(text)


def sample_speech(text: str) -> np.ndarray:
    """Speech of text by espeak-ng when installed (a voice unlike the reply voice),
    else by piper; cached, so tests can share utterances. Returns a copy."""
    return _cached_speech(text).copy()


def with_silence(speech: np.ndarray, before_s: float = 0.5, after_s: float = 1.0) -> np.ndarray:
    """Speech framed by digital silence, as a microphone turn would be."""
    return np.concatenate(
        [np.zeros(int(before_s * SAMPLE_RATE), np.float32), speech.astype(np.float32), np.zeros(int(after_s * SAMPLE_RATE), np.float32)]
    )


def speech_bounds(speech: np.ndarray, level: float = 0.01) -> tuple[int, int]:
    """First and last sample above level: the ground truth of where the speech is."""
    loud = np.flatnonzero(np.abs(speech) > level)
    if loud.size == 0:
        return 0, 0
    return int(loud[0]), int(loud[-1]) + 1
