import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from voice.audio import SAMPLE_RATE, read_wav, resample, write_wav
from voice.samples import sample_speech, with_silence

REPO = Path(__file__).resolve().parents[1]

# Runs a voice module with every network connection refused and an empty Hugging Face
# cache: a run that tried to fetch weights would fail.
OFFLINE_RUNNER = """
import runpy, socket, sys
def refuse(*args, **kwargs):
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_offline(tmp_path: Path, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home"), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", OFFLINE_RUNNER, module, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def write_stereo_44k(path: Path, mono16k: np.ndarray) -> Path:
    """A question as a desktop recorder would save it: 44.1 kHz stereo 16-bit."""
    mono = resample(mono16k, SAMPLE_RATE, 44100)
    frames = (np.stack([mono, mono], axis=1) * 32767).astype("<i2")
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes(frames.tobytes())
    return path


def test_one_offline_turn_from_a_wav(tmp_path):
    wav = write_stereo_44k(tmp_path / "question.wav", with_silence(sample_speech("What time is it right now?"), 0.3, 0.3))
    out = tmp_path / "reply.wav"
    done = run_offline(tmp_path, "voice", "--wav", str(wav), "--json", "--fast", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "time" in result["transcript"].lower()
    assert result["reply"].startswith("It's ")
    assert result["reply_audio"] == str(out)
    samples, rate = read_wav(out)
    assert rate == result["sample_rate"] == 16000
    assert samples.size / rate == pytest.approx(result["reply_audio_seconds"], abs=0.01) and samples.size > rate
    assert {"end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "e2e_latency"} <= set(result["timings_s"])
    assert result["feed"] == "fast_32ms_chunks"


def make_nan_wav(path: Path) -> Path:
    import struct

    data = np.full(1600, np.nan, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 16000, 64000, 4, 32)
    path.write_bytes(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data)) + data)
    return path


def make_hours_wav(path: Path) -> Path:
    import struct

    declared = 2 * 3600 * 16000 * 2
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, 32000, 2, 16)
    path.write_bytes(b"RIFF" + struct.pack("<I", 36 + declared) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", declared) + b"\0" * 3200)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: write_wav(p, np.zeros(SAMPLE_RATE * 2, np.float32), SAMPLE_RATE), "all silence"),
        (lambda p: write_wav(p, 0.003 * np.random.default_rng(1).standard_normal(SAMPLE_RATE * 2), SAMPLE_RATE), "no speech detected"),
        (make_nan_wav, "NaN"),
        (make_hours_wav, "7200.0 s long"),
        (lambda p: p.write_text("hello"), "RIFF"),
    ],
)
def test_bad_wavs_get_a_clear_error(tmp_path, make, message):
    path = tmp_path / "bad.wav"
    make(path)
    started = time.monotonic()
    done = run_offline(tmp_path, "voice", "--wav", str(path), "--json", "--fast", timeout=60)
    assert done.returncode == 2
    assert message in json.loads(done.stdout)["error"]
    assert time.monotonic() - started < 60


def test_bench_reports_stage_latencies(tmp_path):
    done = run_offline(tmp_path, "voice.bench", "--json", "--utterances", "1", timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["feed"].startswith("real time")
    [utterance] = report["utterances"]
    assert utterance["wer"] <= 0.5
    for stage in ("end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "e2e_latency"):
        assert report["stages_s"][stage]["n"] == 1
        assert report["stages_s"][stage]["median"] == report["stages_s"][stage]["p95"] >= 0
    assert report["target"]["limit_s"] == 1.0 and isinstance(report["target"]["met"], bool)
