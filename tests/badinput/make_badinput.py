"""The bad-input corpus: malformed and awkward files every public entry point must meet with a clear
error (non-zero exit, a message naming what was wrong, no traceback) or a bounded result.

    python tests/badinput/make_badinput.py            # rewrites the small files in this folder

Large or derived inputs (very long speech, checkpoints) are made at test time by `long_speech`
and `tampered_checkpoint`, so the committed corpus stays a few kilobytes.
"""

from __future__ import annotations

import json
import struct
import sys
import wave
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RATE = 16_000


def tone(seconds: float, rate: int, hz: float = 180.0) -> np.ndarray:
    """Speech-like: a tone switched on and off four times a second (deterministic)."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(np.float32)


def pcm16_wav(path: Path, x: np.ndarray, rate: int, channels: int = 1) -> None:
    data = (np.repeat(x[:, None], channels, axis=1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(data.tobytes())


def raw_wav(path: Path, data: bytes, *, tag: int = 1, channels: int = 1, rate: int = RATE, bits: int = 16,
            data_size: int | None = None) -> None:
    """A WAV written by hand, so the header may lie about the data."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    size = len(data) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def float_wav(path: Path, x: np.ndarray) -> None:
    raw_wav(path, x.astype("<f4").tobytes(), tag=3, bits=32)


def build(folder: Path = HERE) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    speech = tone(2.0, RATE)
    good = (speech * 32767).astype("<i2").tobytes()
    f = folder
    (f / "empty.wav").write_bytes(b"")
    (f / "not_audio.wav").write_text("this is a text file with a .wav name\n")
    raw_wav(f / "header_only.wav", b"")
    raw_wav(f / "truncated.wav", good[:3200], data_size=len(good))  # the header promises 2 s, 0.1 s follow
    raw_wav(f / "zero_rate.wav", good, rate=0)
    raw_wav(f / "zero_channels.wav", good, channels=0)
    (f / "garbage_after_riff.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunkjunk" + bytes(range(256)))
    short = speech[: RATE // 2]
    nan = short.copy()
    nan[::50] = np.nan
    float_wav(f / "nan.wav", nan)
    inf = short.copy()
    inf[100] = np.inf
    float_wav(f / "inf.wav", inf)
    pcm16_wav(f / "silence.wav", np.zeros(2 * RATE, np.float32), RATE)
    pcm16_wav(f / "rate_8k.wav", tone(2.0, 8_000), 8_000)
    pcm16_wav(f / "stereo_44k.wav", tone(2.0, 44_100), 44_100, channels=2)  # 2 s: the metric's minimum is 1.6 s
    pcm16_wav(f / "too_short.wav", tone(0.02, RATE), RATE)
    (f / "config_broken.json").write_text('{"preset": "fp8-cache", "kv_dtype": ')
    (f / "config_list.json").write_text(json.dumps(["fp8-cache"]))
    (f / "config_unknown_key.json").write_text(json.dumps({"preset": "fp8-cache", "turbo": True}))
    (f / "config_wrong_type.json").write_text(json.dumps({"preset": "fp8-cache", "tp": "two"}))
    (f / "config_unknown_preset.json").write_text(json.dumps({"preset": "fp7-cache"}))
    (f / "corpus_not_npz.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with open(f / "corpus_float.npz", "wb") as out:
        np.savez(out, pcm=short, meta=np.array(json.dumps({"sample_rate": RATE})))
    (f / "sessions_garbage.jsonl").write_text('{"seconds": 10, "fps": 24.1}\nnot json\n{"seconds": "x"}\n{"fps": 3}\n')
    return sorted(p for p in f.iterdir() if p.suffix in (".wav", ".json", ".npz", ".jsonl"))


def long_speech(path: Path, seconds: float) -> Path:
    """Very long speech, 8 kHz 8-bit so 11 minutes stay ~5 MB (made at test time, not committed)."""
    x = tone(seconds, 8_000)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(1), w.setframerate(8_000)
        w.writeframes((x * 127 + 128).astype(np.uint8).tobytes())
    return path


def tampered_checkpoint(folder: Path, spec_name: str = "tiny") -> tuple[Path, Path, Path]:
    """(good, tampered, wrong-spec) DiT checkpoints with their .sha256 sidecars; tampered has one byte flipped."""
    from engine.config import get_spec
    from engine.model import build_model
    from engine.checkpoint import save_checkpoint

    spec = get_spec(spec_name)
    good = folder / "good.pt"
    save_checkpoint(build_model(spec, seed=0), spec, good)
    tampered = folder / "tampered.pt"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    (folder / "tampered.pt.sha256").write_text((folder / "good.pt.sha256").read_text().replace("good.pt", "tampered.pt"))
    other = spec.with_(name=spec.name, dim=spec.dim * 2)
    wrong = folder / "wrong_spec.pt"
    save_checkpoint(build_model(other, seed=0), other, wrong)
    return good, tampered, wrong


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(p.name, p.stat().st_size)
