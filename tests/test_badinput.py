"""The bad-input corpus (tests/badinput/) through every public entry point: each input gets a clear
error (non-zero exit, a message naming what was wrong, no traceback) or a bounded result."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import get_spec
from tests.badinput.make_badinput import HERE, build, long_speech, tampered_checkpoint

BAD = HERE


@pytest.fixture(scope="module")
def long_wav(tmp_path_factory) -> Path:
    return long_speech(tmp_path_factory.mktemp("long") / "eleven_minutes.wav", 11 * 60)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tampered_checkpoint(tmp_path_factory.mktemp("ckpt"))


def call(main, argv, capsys) -> tuple[int, str, str]:
    """An entry point's main in this process: (exit code, stdout, stderr); argparse errors exit 2 too."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def test_the_committed_corpus_is_what_the_script_makes(tmp_path):
    made = build(tmp_path)
    for path in made:
        assert (BAD / path.name).read_bytes() == path.read_bytes(), f"{path.name}: rerun tests/badinput/make_badinput.py"
    assert sum(p.stat().st_size for p in BAD.iterdir()) < 2_000_000


# Audio files: engine.generate, lab.quality lipsync / drift, python -m voice --wav ----------------------------
AUDIO_ERRORS = {  # file -> what the message must name, for every engine entry point that reads audio
    "empty.wav": "cannot decode audio",
    "not_audio.wav": "cannot decode audio",
    "garbage_after_riff.wav": "cannot decode audio",
    "zero_rate.wav": "cannot decode audio",
    "zero_channels.wav": "cannot decode audio",
    "nan.wav": "NaN or infinite",
    "inf.wav": "NaN or infinite",
}
AUDIO_BOUNDED = {"rate_8k.wav": 48, "stereo_44k.wav": 48, "silence.wav": 48, "truncated.wav": 4, "too_short.wav": 4}


@pytest.mark.parametrize("name", sorted(AUDIO_ERRORS))
def test_generate_refuses_broken_audio(name, tmp_path, capsys):
    from engine.generate import main

    code, _, err = call(main, ["--spec", "tiny", "--device", "cpu", "--audio", str(BAD / name), "--out", str(tmp_path / "o.mp4")], capsys)
    assert code == 2 and AUDIO_ERRORS[name] in err and name in err


@pytest.mark.parametrize("name", sorted(AUDIO_BOUNDED))
def test_generate_makes_a_bounded_clip_from_odd_audio(name, tmp_path, capsys):
    from engine.generate import main

    code, out, _ = call(main, ["--spec", "tiny", "--device", "cpu", "--audio", str(BAD / name), "--out", str(tmp_path / "o.mp4")], capsys)
    assert code == 0 and json.loads(out)["frames"] == AUDIO_BOUNDED[name]


def test_generate_refuses_headerless_and_overlong_audio(long_wav, tmp_path, capsys):
    from engine.generate import main

    out = str(tmp_path / "o.mp4")
    code, _, err = call(main, ["--spec", "tiny", "--device", "cpu", "--audio", str(BAD / "header_only.wav"), "--out", out], capsys)
    assert code == 2 and "holds no audio samples" in err
    code, _, err = call(main, ["--spec", "tiny", "--device", "cpu", "--audio", str(long_wav), "--out", out], capsys)
    assert code == 2 and "longer than 600 s" in err
    code, _, err = call(main, ["--spec", "tiny", "--device", "cpu", "--audio", str(tmp_path / "absent.wav"), "--out", out], capsys)
    assert code == 2 and "audio file not found" in err
    code, _, err = call(main, ["--spec", "huge", "--audio", str(BAD / "rate_8k.wav"), "--out", out], capsys)
    assert code == 2 and "invalid choice: 'huge'" in err


@pytest.mark.parametrize("args", [["--device", "nonsense"], ["--out", "/nonexistent-folder/o.mp4"]])
def test_generate_names_a_bad_device_or_output_folder(args, capsys):
    from engine.generate import main

    argv = ["--spec", "tiny", "--device", "cpu", "--audio", str(BAD / "rate_8k.wav"), "--out", "/tmp/o.mp4", *args]
    try:
        code, _, err = call(main, argv, capsys)
    except Exception as e:  # an escaped exception is a traceback at the command line
        pytest.fail(f"escaped: {type(e).__name__}: {e}")
    assert code == 2 and ("nonsense" in err or "nonexistent-folder" in err)


LIPSYNC_TOO_SHORT = ("header_only.wav", "truncated.wav", "too_short.wav")


@pytest.mark.parametrize("name", sorted(AUDIO_ERRORS) + list(LIPSYNC_TOO_SHORT))
def test_lipsync_refuses_broken_or_too_short_audio(name, capsys):
    from lab.quality import main

    code, _, err = call(main, ["lipsync", "--spec", "tiny", "--audio", str(BAD / name)], capsys)
    assert code == 2 and name in err
    assert (AUDIO_ERRORS[name] if name in AUDIO_ERRORS else "the metric needs at least 1.6 s") in err


@pytest.mark.parametrize("name", ["rate_8k.wav", "stereo_44k.wav", "silence.wav"])
def test_lipsync_scores_odd_audio_within_bounds(name, capsys):
    from lab.quality import main

    code, out, _ = call(main, ["lipsync", "--spec", "tiny", "--audio", str(BAD / name), "--max-offset", "8", "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["frames"] == 48
    for part in ("generated", "ceiling", "floor"):
        assert -2.0 <= report[part]["score"] <= 2.0 and abs(report[part]["best_offset"]) <= 8


def test_lipsync_and_drift_refuse_overlong_or_soundless_audio(long_wav, capsys):
    from lab.quality import main

    code, _, err = call(main, ["lipsync", "--spec", "tiny", "--audio", str(long_wav)], capsys)
    assert code == 2 and "longer than 120 s" in err
    code, _, err = call(main, ["drift", "--spec", "tiny", "--minutes", "1", "--audio", str(BAD / "silence.wav")], capsys)
    assert code == 2 and "holds no sound" in err
    code, _, err = call(main, ["drift", "--spec", "tiny", "--minutes", "1", "--audio", str(BAD / "nan.wav")], capsys)
    assert code == 2 and "NaN or infinite" in err


VOICE_ERRORS = {
    "empty.wav": "not a RIFF/WAVE file", "not_audio.wav": "not a RIFF/WAVE file", "garbage_after_riff.wav": "no data chunk",
    "header_only.wav": "audio is empty", "nan.wav": "NaN or infinite", "inf.wav": "NaN or infinite",
    "zero_rate.wav": "invalid format header", "zero_channels.wav": "invalid format header",
    "silence.wav": "all silence", "truncated.wav": "no speech detected", "too_short.wav": "no speech detected",
}


@pytest.mark.parametrize("name", sorted(VOICE_ERRORS))
def test_voice_turn_refuses_bad_wavs(name, capsys):
    from voice.__main__ import main

    code, out, err = call(main, ["--wav", str(BAD / name), "--fast", "--timeout", "30", "--json"], capsys)
    assert code == 2 and VOICE_ERRORS[name] in err and "error" in json.loads(out)


def test_voice_turn_refuses_very_long_speech(long_wav, capsys):
    from voice.__main__ import main

    code, _, err = call(main, ["--wav", str(long_wav), "--fast"], capsys)
    assert code == 2 and "long; the limit is" in err


# Configurations: lab.quality compare / drift, lab.soak ------------------------------------------------------
CONFIG_ERRORS = {
    "config_broken.json": "is not valid JSON", "config_list.json": "must hold a JSON object",
    "config_unknown_key.json": "unknown config key 'turbo'", "config_wrong_type.json": "tp must be a whole number",
    "config_unknown_preset.json": "unknown config preset 'fp7-cache'",
}


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_broken_config_files_are_named_by_every_config_entry_point(name, capsys):
    from lab.quality import main as quality
    from lab.soak import main as soak

    path = str(BAD / name)
    for entry, argv in [(quality, ["compare", "--spec", "tiny", "--a", "reference", "--b", path, "--clips", "2"]),
                        (quality, ["drift", "--spec", "tiny", "--config", path]),
                        (soak, ["--spec", "tiny", "--config", path, "--seconds", "1"])]:
        code, _, err = call(entry, argv, capsys)
        assert code == 2 and CONFIG_ERRORS[name] in err


def test_unknown_presets_everywhere(capsys):
    from engine.generate import main as generate
    from lab.quality import main as quality
    from lab.soak import main as soak

    code, _, err = call(quality, ["compare", "--spec", "tiny", "--a", "fast", "--b", "reference"], capsys)
    assert code == 2 and "unknown config preset 'fast'" in err
    code, _, err = call(quality, ["lipsync", "--spec", "tiny", "--audio", str(BAD / "rate_8k.wav"), "--preset", "zed"], capsys)
    assert code == 2 and "zed" in err
    code, _, err = call(soak, ["--spec", "tiny", "--preset", "zed"], capsys)
    assert code == 2 and "zed" in err
    code, _, err = call(generate, ["--spec", "tiny", "--audio", "x.wav", "--out", "o.mp4", "--attention", "warp"], capsys)
    assert code == 2 and "invalid choice: 'warp'" in err


# Checkpoints: weights loading, engine.generate --weights, lab.quality --weights ---------------------------------
def test_a_tampered_checkpoint_is_refused_by_its_sha256(checkpoints, capsys):
    from engine.generate import main as generate
    from lab.quality import main as quality
    from engine.weights import load_engine

    good, tampered, wrong = checkpoints
    spec = get_spec("tiny")
    model, _, trained = load_engine(spec, weights=good, stand_in_codec=True)  # the DiT alone: no codec beside it
    assert model is not None and trained is False
    with pytest.raises(ValueError, match="fails its sha256 check"):
        load_engine(spec, weights=tampered)
    with pytest.raises(ValueError, match="does not match spec tiny: dim"):
        load_engine(spec, weights=wrong)
    code, _, err = call(generate, ["--spec", "tiny", "--device", "cpu", "--audio", str(BAD / "rate_8k.wav"), "--out",
                                   str(good.parent / "o.mp4"), "--weights", str(tampered)], capsys)
    assert code == 2 and "fails its sha256 check" in err
    code, _, err = call(quality, ["lipsync", "--spec", "tiny", "--audio", str(BAD / "rate_8k.wav"), "--weights", str(tampered)], capsys)
    assert code == 2 and "fails its sha256 check" in err


def test_a_checkpoint_without_its_digest_is_still_checked_for_format(tmp_path, checkpoints):
    from engine.weights import load_engine

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a readable talkloop checkpoint"):
        load_engine(get_spec("tiny"), weights=junk)
    with pytest.raises(ValueError, match="checkpoint not found"):
        load_engine(get_spec("tiny"), weights=tmp_path / "absent.pt")
    bare = tmp_path / "bare.pt"
    torch.save({"weights": 1}, bare)
    with pytest.raises(ValueError, match="lacks its spec or weights"):
        load_engine(get_spec("tiny"), weights=bare)


# training.train corpus / codec arguments, lab.bench, engine.session_log -----------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["corpus", "--out", "{tmp}/c.npz", "--source", "tape"], "unknown corpus sources ['tape']"),
    (["corpus", "--out", "{tmp}/c.npz", "--minutes", "-1", "--source", "synth"], "corpus length must be positive"),
    (["codec", "--spec", "tiny", "--device", "cpu", "--corpus", "{bad}/corpus_not_npz.npz", "--work", "{tmp}"], "is not a talkloop speech corpus"),
    (["codec", "--spec", "tiny", "--device", "cpu", "--corpus", "{bad}/corpus_float.npz", "--work", "{tmp}"], "corpus must be 1-D int16"),
    (["codec", "--spec", "tiny", "--device", "cpu", "--corpus", "{tmp}/absent.npz", "--work", "{tmp}"], "corpus not found"),
    (["dit", "--spec", "tiny", "--device", "cuda", "--corpus", "{bad}/corpus_float.npz"], "CUDA"),
    (["codec", "--spec", "huge"], "invalid choice: 'huge'"),
])
def test_train_arguments_are_checked(argv, message, tmp_path, capsys):
    from training.train import main

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    argv = [a.format(tmp=tmp_path, bad=BAD) for a in argv]
    code, _, err = call(main, argv, capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("argv, message", [
    (["cache", "--device", "cuda"], "no CUDA GPU is visible"),
    (["cache", "--device", "cpu", "--tp-shard", "4"], "tensor-parallel degree 4 must divide"),
    (["cache", "--device", "cpu", "--spec", "huge"], "invalid choice: 'huge'"),
    (["allreduce", "--world", "1", "--device", "cpu"], "argument --world: must be at least 2, got 1"),
    (["step", "--device", "cpu"], "needs a CUDA GPU"),
    (["step", "--tp-shard", "0"], "argument --tp-shard: must be at least 1, got 0"),
    (["step", "--attention-options", "{kernel: ws}"], "argument --attention-options: not JSON"),
    (["step", "--attention-options", "[1]"], "argument --attention-options: a JSON object is needed"),
    (["step", "--attention-options", '{"kernel": "fa3"}'], "kernel must be one of auto, triton, ws, got 'fa3'"),
    (["pipeline", "--device", "cpu", "--gpus", "0"], "GPU 0 in --gpus is not visible"),
    (["teleport"], "invalid choice: 'teleport'"),
])
def test_bench_arguments_are_checked(argv, message, capsys):
    from lab.bench import main

    if "cuda" in " ".join(argv) and torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    code, _, err = call(main, argv, capsys)
    assert code == 2 and message in err


def test_bench_names_an_unknown_device(capsys):
    from lab.bench import main

    try:
        code, _, err = call(main, ["cache", "--device", "nonsense"], capsys)
    except Exception as e:
        pytest.fail(f"escaped: {type(e).__name__}: {e}")
    assert code == 2 and "nonsense" in err


def test_session_log_with_garbage_lines_gives_a_bounded_summary(tmp_path, capsys):
    from lab.session_report import main

    code, out, _ = call(main, ["--log", str(BAD / "sessions_garbage.jsonl")], capsys)
    summary = json.loads(out)
    assert code == 0 and summary["sessions"] == 1 and summary["unreadable_lines"] == 3
    code, _, err = call(main, ["--log", str(tmp_path / "absent.jsonl")], capsys)
    assert code == 2 and "session log not found" in err


# At the command line: exit status and message, no traceback ---------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["engine.generate", "--spec", "tiny", "--audio", str(BAD / "not_audio.wav"), "--out", "/tmp/o.mp4"], "cannot decode audio"),
    (["lab.quality", "compare", "--a", str(BAD / "config_broken.json"), "--b", "reference"], "is not valid JSON"),
    (["voice", "--wav", str(BAD / "nan.wav")], "NaN or infinite"),
])
def test_command_lines_fail_with_a_message_and_no_traceback(argv, message):
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **_python_env()})
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def _python_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH", "VIRTUAL_ENV", "PATH", "TRITON_INTERPRET")}
