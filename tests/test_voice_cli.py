import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from engine.audio import SAMPLE_RATE, read_wav, resample, write_wav
from voice.options import add_loop_args, build_agent
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
    wav = write_stereo_44k(tmp_path / "question.wav", with_silence(sample_speech("What is the capital of France?"), 0.3, 0.3))
    out = tmp_path / "reply.wav"
    done = run_offline(tmp_path, "voice", "--wav", str(wav), "--json", "--fast", "--out", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "capital of france" in result["transcript"].lower()
    assert "paris" in result["reply"].lower()  # the local language model, with every network connection refused
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
    os.truncate(path, 44 + declared)  # the two hours are there (a sparse file: no disk behind them)
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
    done = run_offline(tmp_path, "lab.voice_bench", "--json", "--utterances", "1", timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["feed"].startswith("real time")
    [utterance] = report["utterances"]
    assert utterance["wer"] <= 0.5
    for stage in ("end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "e2e_latency"):
        assert report["stages_s"][stage]["n"] == 1
        assert report["stages_s"][stage]["median"] == report["stages_s"][stage]["p95"] >= 0
    assert report["target"]["limit_s"] == 1.3 and isinstance(report["target"]["met"], bool)


def loop_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voice-test")
    add_loop_args(parser)
    return parser


@pytest.mark.parametrize("flags, message", [
    (["--threshold", "50"], "argument --threshold: must be a probability between 0 and 1"),
    (["--threshold", "0"], "argument --threshold"),
    (["--sample-rate", "0"], "argument --sample-rate: must be a sample rate in Hz > 0"),
    (["--sample-rate", "-48000"], "argument --sample-rate"),
    (["--min-silence-ms", "-1"], "argument --min-silence-ms: must be a whole number of milliseconds >= 0"),
    (["--speech-pad-ms", "-5"], "argument --speech-pad-ms"),
    (["--chat-timeout", "0"], "argument --chat-timeout: must be a finite number of seconds > 0"),
])
def test_loop_options_that_could_never_work_are_refused_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        loop_parser().parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_chat_options_reach_the_agent():
    args = loop_parser().parse_args(["--agent", "openai", "--chat-timeout", "4.5", "--think-opened", "--preset", "kofi",
                                     "--system-prompt", 'I am {name}; answer {"like": "this"}'])
    agent = build_agent(args)
    assert (agent.timeout_s, agent.think_opened) == (4.5, True)
    assert agent.system_prompt == 'I am Kofi; answer {"like": "this"}'
    assert loop_parser().parse_args([]).chat_timeout == 30.0


class ScriptedTurn:
    def __init__(self, user_text: str, e2e_s: float) -> None:
        self.info = {"user_text": user_text, "reply_text": "Sure.", "status": "completed"}
        self.written = True
        self._durations = {"stt": 0.1, "e2e_latency": e2e_s}

    def durations(self) -> dict[str, float]:
        return self._durations


class ScriptedLoop:
    """Stands in for the VoiceLoop in lab.voice_bench: each question fed is heard as the next scripted turn (None: not
    heard at all)."""

    def __init__(self, turns: list[ScriptedTurn | None]) -> None:
        self.script = iter(turns)
        self.trace = SimpleNamespace(turns=[])
        self.is_speaking = False
        self.asr = SimpleNamespace(device="cpu", compute_type="int8", warm_up=lambda: None)
        self.tts = SimpleNamespace(warm_up=lambda: None)
        self.config = SimpleNamespace(partial_interval_s=0.25)
        self.closed = False

    def feed(self, audio: np.ndarray, clock: float | None) -> float:
        if np.any(audio):  # a question, not the silence after it
            turn = next(self.script)
            if turn is not None:
                self.trace.turns.append(turn)
        return (clock or 0.0) + audio.size / SAMPLE_RATE

    def close(self) -> None:
        self.closed = True


def run_bench_main(monkeypatch, capsys, loop: ScriptedLoop, *flags: str) -> tuple[int, dict]:
    import lab.voice_bench

    monkeypatch.setattr(lab.voice_bench, "piper_speech", lambda text, **_: np.full(1600, 0.1, np.float32))
    monkeypatch.setattr(lab.voice_bench, "build_loop", lambda args, sink: loop)
    monkeypatch.setattr(lab.voice_bench, "feed_audio", lambda loop, audio, real_time, clock=None: loop.feed(audio, clock))
    code = lab.voice_bench.main(["--json", "--turn-timeout", "1", *flags])

    def no_nan(name: str):
        raise AssertionError(f"{name} is not JSON")

    return code, json.loads(capsys.readouterr().out, parse_constant=no_nan)


def test_bench_counts_an_unheard_question_against_wer_and_target(monkeypatch, capsys):
    loop = ScriptedLoop([ScriptedTurn("Hello, how are you doing today?", 0.4), None])
    code, report = run_bench_main(monkeypatch, capsys, loop, "--utterances", "2")
    assert code == 0 and loop.closed
    assert (report["answered"], report["questions"]) == (1, 2)
    assert report["mean_wer"] == 0.5  # the heard question's 0.0 and the unheard one's 1.0
    assert report["target"]["median_s"] == 0.4 and report["target"]["every_question_answered"] is False
    assert report["target"]["met"] is False


def test_bench_with_nothing_heard_still_writes_valid_json(monkeypatch, capsys):
    code, report = run_bench_main(monkeypatch, capsys, ScriptedLoop([None, None, None]), "--utterances", "3")
    assert code == 0
    assert report["mean_wer"] == 1.0 and report["answered"] == 0
    assert report["stages_s"]["e2e_latency"] == {"n": 0} and report["target"]["met"] is False


def test_bench_failures_exit_2_with_the_message_and_ctrl_c_exits_130(monkeypatch, capsys, tmp_path):
    import lab.voice_bench
    import voice.samples

    missing = tmp_path / "missing.onnx"
    assert lab.voice_bench.main(["--utterances", "1", "--voice", str(missing)]) == 2
    assert f"error: ValueError: piper voice not found: {missing}" in capsys.readouterr().err
    monkeypatch.setattr(voice.samples, "espeak_available", lambda: False)
    assert lab.voice_bench.main(["--utterances", "1", "--speech", "espeak", "--json"]) == 2
    assert "espeak-ng is not installed" in json.loads(capsys.readouterr().out)["error"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    loop = ScriptedLoop([None])
    monkeypatch.setattr(lab.voice_bench, "piper_speech", lambda text, **_: np.full(1600, 0.1, np.float32))
    monkeypatch.setattr(lab.voice_bench, "build_loop", lambda args, sink: loop)
    monkeypatch.setattr(lab.voice_bench, "feed_audio", interrupted)
    try:
        assert lab.voice_bench.main(["--utterances", "1"]) == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped lab.voice_bench.main")
    assert loop.closed and "error: interrupted" in capsys.readouterr().err


def test_ctrl_c_ends_a_wav_turn_with_status_130(monkeypatch, capsys, tmp_path):
    import voice.__main__

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(voice.__main__, "run_wav_turn", interrupted)
    try:
        assert voice.__main__.main(["--wav", str(tmp_path / "q.wav"), "--json"]) == 130
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped voice.__main__.main")
    assert json.loads(capsys.readouterr().out) == {"error": "interrupted"}


def test_a_reply_path_the_command_cannot_write_is_refused_before_the_models_load(tmp_path, monkeypatch, capsys):
    """--out is a .wav file in an existing folder, or an existing folder; anything else is named at once (it used
    to create folders, and --out reply.mp3 became a folder holding reply.wav)."""
    import voice.__main__ as cli

    monkeypatch.setattr(cli, "run_wav_turn", lambda args: pytest.fail("the turn ran"))
    wav = tmp_path / "q.wav"
    wav.write_bytes(b"")
    for out, message in ((tmp_path / "reply.mp3", "give a .wav file or an existing folder"),
                         (tmp_path / "missing" / "reply.wav", "does not exist")):
        assert cli.main(["--wav", str(wav), "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "reply.mp3").exists() and not (tmp_path / "missing").exists()
    assert cli.reply_path(str(tmp_path)) == tmp_path / "reply.wav"
