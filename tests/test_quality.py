"""The lip-sync metric: reads the mouth from pixels, ranks synced above shifted above shuffled."""

import json
import sys
import wave
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import character as ch
from engine.audio import SAMPLE_RATE
from lab.quality import (
    audio_envelope,
    main,
    mouth_motion,
    mouth_opening,
    offset_correlations,
    picture_stats,
    read_audio,
    shuffled_floor,
    sync_scores,
)
from training.train import make_corpus

SIZE = (96, 96)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    pcm16, _ = make_corpus(10.0, seed=11, sources=("synth",))
    return pcm16.astype(np.float32) / 32768.0


def test_mouth_reading_tracks_the_renderer(speech):
    frames, states = ch.render_audio(speech[: 4 * SAMPLE_RATE], "sol", seed=2, size=SIZE)
    opening = mouth_opening(frames, "sol")
    assert np.corrcoef(opening.numpy(), states[:, ch.S["open"]].numpy())[0, 1] > 0.95
    # Blur (as a soft decoder would) keeps the reading.
    soft = torch.nn.functional.avg_pool2d(frames.permute(0, 3, 1, 2).float(), 3, 1, 1).round().to(torch.uint8)
    assert np.corrcoef(opening.numpy(), mouth_opening(soft.permute(0, 2, 3, 1), "sol").numpy())[0, 1] > 0.98


def test_metric_ranks_synced_above_shifted_above_shuffled(speech):
    n = len(speech) * 24 // SAMPLE_RATE
    env = audio_envelope(speech, n)
    synced, _ = ch.render_audio(speech, "mika", seed=1, size=SIZE, n_frames=n)
    late = np.concatenate([np.zeros(SAMPLE_RATE // 4, np.float32), speech])[: speech.size]  # mouth 6 frames late
    shifted, _ = ch.render_audio(late, "mika", seed=1, size=SIZE, n_frames=n)
    s_sync = sync_scores(mouth_opening(synced, "mika"), env)
    s_shift = sync_scores(mouth_opening(shifted, "mika"), env)
    floor = shuffled_floor(mouth_opening(synced, "mika"), env)
    assert s_sync["best_offset"] == 0 and s_shift["best_offset"] == 6
    assert s_sync["score"] > s_shift["score"] + 0.2
    assert s_shift["score"] > floor["score"]
    assert s_sync["confidence"] > floor["confidence"] + 0.2


def test_mouth_motion_tells_a_group_held_as_one_picture_from_per_frame_motion(speech):
    frames, _ = ch.render_audio(speech[: 4 * SAMPLE_RATE], "ada", seed=2, size=SIZE)
    moving = mouth_motion(frames, "ada")
    assert 0.5 < moving["within_to_across"] < 2.0  # the renderer moves every frame alike
    held = frames[(torch.arange(frames.shape[0]) // 4) * 4]  # each group of 4 shows its first frame
    still = mouth_motion(held, "ada")
    assert still["within_group"] == 0 and still["across_groups"] > 0 and still["within_to_across"] == 0
    with pytest.raises(ValueError, match="frames must be"):
        mouth_motion(frames[:5], "ada")


def test_offsets_are_signed_as_mouth_lag():
    env = torch.randn(200, generator=torch.Generator().manual_seed(0))
    mouth = torch.cat([torch.zeros(3), env[:-3]])  # the mouth trails the audio by 3 frames
    c = offset_correlations(mouth, env, 10)
    assert int(c.argmax()) - 10 == 3 and c.max() > 0.99


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="NaN"):
        audio_envelope(np.full(1600, np.nan, np.float32), 2)
    with pytest.raises(ValueError, match="too few"):
        sync_scores(torch.zeros(20), torch.zeros(20))
    with pytest.raises(ValueError, match="uint8"):
        mouth_opening(torch.zeros(2, 64, 64, 3), "ada")
    with pytest.raises(ValueError, match="unknown preset"):
        mouth_opening(torch.zeros(2, 64, 64, 3, dtype=torch.uint8), "zed")


def test_picture_stats():
    flat = torch.full((2, 16, 16, 3), 100, dtype=torch.uint8)
    noisy = torch.randint(0, 255, (2, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert picture_stats(flat) == {"brightness": pytest.approx(100.0, abs=0.1), "sharpness": 0.0}
    assert picture_stats(noisy)["sharpness"] > 100


def _write_wav(path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes())


def test_cli_reports_generated_ceiling_and_floor(tmp_path, speech, capsys):
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    assert main(["lipsync", "--spec", "tiny", "--audio", str(wav), "--json", "--max-offset", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"generated", "ceiling", "floor", "ratio_to_ceiling", "steps_per_second", "motion"} <= set(report)
    assert report["frames"] == 72 and report["ceiling"]["score"] > report["floor"]["score"]
    assert report["rendered_motion"]["per_frame"] > 0 and report["motion"]["within_to_renderer"] is not None
    assert main(["lipsync", "--spec", "tiny", "--audio", str(wav), "--json", "--max-offset", "8", "--minutes", "0.1"]) == 0
    long = json.loads(capsys.readouterr().out)
    assert long["per_minute"] and set(long["first_vs_last"]) == {"score", "confidence", "brightness", "sharpness", "ref_diff"}
    assert long["ceiling_first_minute"]["score"] > 0
    assert main(["lipsync", "--spec", "tiny", "--audio", str(tmp_path / "none.wav")]) == 2
    assert main(["lipsync", "--spec", "tiny", "--audio", str(wav), "--preset", "zed"]) == 2


def test_wav_files_are_read_without_pyav(tmp_path, speech, monkeypatch):
    """Where PyAV is absent the lab still reads WAV files (through engine.audio), and says why it refuses others."""
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[:SAMPLE_RATE])
    with_pyav = read_audio(wav, max_seconds=10)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now fails as on a host without PyAV
    np.testing.assert_allclose(read_audio(wav, max_seconds=10), with_pyav, atol=1e-4)
    with pytest.raises(ValueError, match="not found"):
        read_audio(tmp_path / "none.wav", max_seconds=10)
    with pytest.raises(ValueError, match="1.0 s long; the limit is"):
        read_audio(wav, max_seconds=0.5)
    mp3 = tmp_path / "x.mp3"
    mp3.write_bytes(b"ID3" + bytes(64))
    with pytest.raises(ValueError, match="not a RIFF/WAVE file.*PyAV"):
        read_audio(mp3, max_seconds=10)


def test_contact_sheet_png(tmp_path, speech, capsys):
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[:SAMPLE_RATE])
    out = tmp_path / "sheet.png"
    assert main(["sheet", "--spec", "tiny", "--audio", str(wav), "--presets", "ada,kofi", "--out", str(out),
                 "--every", "2", "--columns", "4"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (4 * 32, 4 * 32)  # 4 columns; generated + renderer rows for 2 presets
    assert json.loads(capsys.readouterr().out)["rows"] == 4


# Engine configurations and compare ----------------------------------------------------------
from engine.config import get_spec  # noqa: E402
from engine.options import CONFIG_PRESETS, EngineOptions, attention_p_options, parse_options  # noqa: E402
from lab.quality import compare, drift_verdict, mean_ci95, t_quantile_975, verdict  # noqa: E402


def test_configs_are_presets_with_overrides_or_json_files(tmp_path):
    c = parse_options("fp8-cache,reset_every=0,kv_dtype=bf16")
    assert (c.cache, c.kv_dtype, c.reset_every, c.tp) == ("ring", "bf16", 0, 1)
    assert parse_options("reference").cache == "reference"
    assert parse_options("tp2,fused_allreduce=yes").fused_allreduce is True
    assert parse_options("fp8-cache,adaptive_lead=true").adaptive_lead is True and not parse_options("fp8-cache").adaptive_lead
    f = tmp_path / "b.json"
    f.write_text(json.dumps({"preset": "ring-fp32", "reset_every": 3}))
    assert (parse_options(str(f)).kv_dtype, parse_options(str(f)).reset_every) == ("fp32", 3)
    assert set(CONFIG_PRESETS) >= {"reference", "ring-fp32", "fp8-cache", "fp8-attention", "tp2", "tp3", "cuda-graph"}


@pytest.mark.parametrize("text, message", [
    ("refrence", "unknown config preset 'refrence'"),
    ("fp8-cache,colour=red", "unknown config key 'colour'"),
    ("fp8-cache,tp=two", "tp must be a whole number"),
    ("fp8-cache,kv_dtype=fp4", "kv_dtype must be one of"),
    ("fp8-cache,tp", "not key=value"),
    ("reference,backend=triton", "triton backend needs cache=ring"),
    ("reference,fused_allreduce=true", "fused_allreduce needs tp >= 2"),
    ("fp8-cache,decoder_gpu=1", "decoder_gpu needs the engine's own processes"),
    ("fp8-cache,cuda_graph=maybe", "must be true or false"),
    ("fp8-cache,reset_every=-1", "reset_every must be >= 0"),
])
def test_bad_configs_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_options(text)


def test_engine_processes_on_a_gpu_other_than_0_are_refused(monkeypatch):
    """The engine's own processes take GPUs 0..tp-1: device=cuda:1 with them would run on GPU 0 unsaid."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="take GPUs 0..0, not cuda:1"):
        parse_options("fp8-cache,processes=true,device=cuda:1")
    assert parse_options("fp8-cache,device=cuda:1").device == "cuda:1"  # in-process: that GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_graph_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA GPU"):
        parse_options("cuda-graph")


def test_fast_accumulation_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="gemm=fp8-fast needs a CUDA GPU"):
        parse_options("fp8-gemm-fast,device=cpu")


def test_attention_kernel_choices_are_checked():
    with pytest.raises(ValueError, match="attention=ws .* needs a CUDA GPU"):
        parse_options("fp8-attention,attention=ws,device=cpu")
    with pytest.raises(ValueError, match="attention=triton picks a kernel of backend=triton, not of backend=torch"):
        parse_options("fp8-cache,attention=triton")
    assert "attention=auto" in parse_options("fp8-attention").describe()  # results name the rule that picked the kernel
    with pytest.raises(ValueError, match="attention must be one of auto, triton, ws, got 'flash'"):
        parse_options("fp8-attention,attention=flash")
    with pytest.raises(ValueError, match="attention_p must be one of auto, nearest, log-linear, got 'linear'"):
        parse_options("fp8-attention,attention=ws,attention_p=linear")
    with pytest.raises(ValueError, match="attention_p=log-linear is an option of the ws kernel: add attention=ws"):
        parse_options("fp8-attention,attention=triton,attention_p=log-linear")
    with pytest.raises(ValueError, match="attention_p=nearest is an option of the ws kernel: add attention=ws"):
        parse_options("fp8-attention,attention_p=nearest")
    assert attention_p_options("auto") == {}  # the ring's served options
    assert attention_p_options("nearest") == {"exp2": "mufu", "row_sum": "fma"}
    assert attention_p_options("log-linear") == {"exp2": "e4m3_bits", "row_sum": "tensor"}


def test_broken_config_files_are_named(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"preset": "fp8-cache", ')
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        parse_options(str(broken))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        parse_options(str(listed))
    nameless = tmp_path / "nameless.json"
    nameless.write_text('{"kv_dtype": "fp8"}')
    with pytest.raises(ValueError, match="needs \"preset\""):
        parse_options(str(nameless))
    with pytest.raises(ValueError, match="config file not found"):
        parse_options(str(tmp_path / "absent.json"))


def test_interval_and_verdict():
    ci = mean_ci95([1.0, 2.0, 3.0])
    assert ci["mean"] == pytest.approx(2.0)
    assert ci["ci95"] == pytest.approx([2.0 - 4.303 / 3**0.5, 2.0 + 4.303 / 3**0.5], abs=1e-3)
    assert t_quantile_975(60) == pytest.approx(2.000, abs=0.003)
    rerun = {"mean": 0.0, "ci95": [-0.05, 0.04]}
    inside = verdict({"mean": 0.01, "ci95": [-0.02, 0.04]}, rerun)
    outside = verdict({"mean": 0.1, "ci95": [0.06, 0.14]}, rerun)
    assert inside["within_rerun_band"] and inside["rerun_band"] == [-0.05, 0.05] and inside["seed_thresholds_met"]
    assert not outside["within_rerun_band"] and not outside["seed_thresholds_met"]
    with pytest.raises(ValueError, match="at least 2 clips"):
        mean_ci95([1.0])


def test_compare_runs_a_twice_and_each_b(capsys):
    spec = get_spec("tiny")
    a = parse_options("reference")
    report = compare(spec, a, [parse_options("ring-fp32"), parse_options("tp2")], clips=2, clip_seconds=2.0,
                     source="synth", max_offset=8)
    assert report["clips"] == 2 and len(report["per_clip"]) == 2 and "fresh sampling-noise seed" in report["rerun_definition"]
    ring, tp2 = report["comparisons"]
    # Same noise seed: the ring path and two tensor-parallel ranks make (nearly) A's frames; a rerun does not.
    assert ring["pixel_diff_b_vs_a"] < 0.5 and tp2["pixel_diff_b_vs_a"] < 0.5
    assert ring["pixel_diff_rerun"] > 5.0
    assert abs(ring["diff_b_minus_a"]["mean"]) < 0.01 and ring["within_rerun_band"]
    assert {r["look"] for r in report["per_clip"]} == set(list(ch.PRESETS)[:2])


def test_compare_cli_errors_without_traceback(capsys):
    assert main(["compare", "--spec", "tiny", "--a", "reference", "--b", "tp9", "--clips", "2"]) == 2
    assert "unknown config preset 'tp9'" in capsys.readouterr().err
    assert main(["compare", "--spec", "tiny", "--a", "reference", "--b", "tp3", "--clips", "2"]) == 2
    assert "degree 3 must divide n_heads 4" in capsys.readouterr().err
    assert main(["compare", "--spec", "tiny", "--a", "reference", "--b", "fp8-cache", "--clips", "1"]) == 2
    assert "--clips must be at least 2" in capsys.readouterr().err


def test_drift_subcommand_gives_a_verdict(tmp_path, speech, capsys):
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    assert main(["drift", "--spec", "tiny", "--minutes", "2", "--audio", str(wav), "--max-offset", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["minute"] for r in report["per_minute"]] == [0, 1]
    assert report["position_resets"] == 2 * 360 // 5  # tiny: a reset every 5 steps
    drift, fl, rows = report["drift"], report["first_vs_last"], report["per_minute"]
    assert drift["minutes_compared"] == [0, 1] and drift["limits"]["score_drop"] == 0.08  # the CLI's defaults
    for key in ("score", "brightness", "sharpness", "ref_diff"):
        assert (fl[key]["first"], fl[key]["last"]) == (rows[0][key], rows[1][key])
    # The documented rule, from the report's own figures: stable unless the score fell by more than 0.08,
    # brightness or ref_diff moved by more than 8 levels, or sharpness changed by more than 25%.
    crossed = [-fl["score"]["change"] > 0.08, abs(fl["brightness"]["change"]) > 8.0, abs(fl["ref_diff"]["change"]) > 8.0,
               abs(fl["sharpness"]["change"]) / fl["sharpness"]["first"] > 0.25]
    assert drift["verdict"] == ("drifting" if any(crossed) else "stable") and len(drift["reasons"]) == sum(crossed)
    assert main(["drift", "--spec", "tiny", "--minutes", "0", "--audio", str(wav)]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err


def test_drift_verdict_names_what_moved():
    def report(score_change, bright_change):
        fl = {"score": {"first": 0.5, "last": 0.5 + score_change, "change": score_change},
              "confidence": {"first": 0.5, "last": 0.5, "change": 0.0},
              "brightness": {"first": 100.0, "last": 100 + bright_change, "change": bright_change},
              "sharpness": {"first": 50.0, "last": 50.0, "change": 0.0},
              "ref_diff": {"first": 10.0, "last": 10.0, "change": 0.0}}
        return {"first_vs_last": fl, "per_minute": [{"minute": 0, "score": 0.5}, {"minute": 1, "score": 0.5 + score_change}]}

    assert drift_verdict(report(-0.01, 1.0))["verdict"] == "stable"
    bad = drift_verdict(report(-0.2, 12.0))
    assert bad["verdict"] == "drifting" and len(bad["reasons"]) == 2 and bad["score_slope_per_minute"] == pytest.approx(-0.2)
    one_minute = {**report(0.0, 0.0), "per_minute": [{"minute": 0, "score": 0.5}]}  # first and last are the same minute
    assert drift_verdict(one_minute)["verdict"] == "too short to tell"


def test_a_sheet_written_to_a_folder_is_refused_before_any_work(tmp_path, speech, capsys):
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    assert main(["sheet", "--spec", "tiny", "--audio", str(wav), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def _one_push_frames(spec, pcm: np.ndarray, look: str, seed: int) -> np.ndarray:
    """Frames of a session fed the whole clip in one push (weights and noise both from `seed`)."""
    from engine.realtime import RealtimeCharacter
    from engine.session import EngineSession
    from engine.weights import load_engine

    model, codec, _ = load_engine(spec, seed=seed)
    session = EngineSession(model, cache="ring", kv_dtype="fp8", seed=seed)
    session.start(codec.encode_reference(ch.reference_image(look, spec.image_size)))
    character = RealtimeCharacter(session, codec, group_blend=EngineOptions().group_blend)  # as the engine is built
    character.push_audio(pcm, SAMPLE_RATE)
    steps = -(-len(pcm) * spec.fps // SAMPLE_RATE) // spec.frames_per_latent
    return np.concatenate([np.stack([f.rgb for f in character.make_step()]) for _ in range(steps)])


def test_frames_push_audio_in_chunks_yet_match_one_push(monkeypatch):
    """engine_frames (lipsync, its --minutes, sheet) and config_frames (compare, drift) push the audio a
    chunk at a time, so a step's features never scan a long session's whole timeline; the frames are
    those of one push."""
    from lab.quality import config_frames, engine_frames, speech_clip
    from engine.realtime import RealtimeCharacter

    spec = get_spec("tiny")
    pcm = speech_clip(3, 7.0, "synth")  # more than the 2 s chunk, so several pushes
    whole = _one_push_frames(spec, pcm, "ada", seed=0)
    pushed = []
    real_push = RealtimeCharacter.push_audio

    def recording_push(self, chunk, sample_rate):
        pushed.append(len(chunk))
        return real_push(self, chunk, sample_rate)

    monkeypatch.setattr(RealtimeCharacter, "push_audio", recording_push)
    gen, _ = engine_frames(spec, pcm, "ada")
    from_engine = np.concatenate([rgb for _, rgb in gen])
    assert len(pushed) > 1 and max(pushed) <= 2 * SAMPLE_RATE and sum(pushed) == pcm.size
    gen, _ = config_frames(parse_options("fp8-cache"), spec, pcm, "ada", noise_seed=0)
    from_config = np.concatenate([rgb for _, rgb in gen])
    assert whole.shape == (168, 32, 32, 3)
    assert np.array_equal(from_engine, whole) and np.array_equal(from_config, whole)


def test_lipsync_steps_per_second_counts_stepping_only(speech, monkeypatch):
    """Loading the engine is not stepping: a load that takes 1000 s leaves the rate unchanged."""
    import engine.build
    from lab import quality

    offset = [0.0]
    real_clock, real_load = quality.time.perf_counter, engine.build.load_engine

    def slow_load(*args, **kwargs):
        offset[0] += 1000.0
        return real_load(*args, **kwargs)

    monkeypatch.setattr(quality, "time", SimpleNamespace(perf_counter=lambda: real_clock() + offset[0]))
    monkeypatch.setattr(engine.build, "load_engine", slow_load)
    report = quality.lipsync_report(get_spec("tiny"), speech[: 3 * SAMPLE_RATE], max_offset=8)
    assert offset[0] == 1000.0 and report["steps_per_second"] > 18 / 100  # 18 steps, well under 100 s


@pytest.mark.parametrize("argv", [
    ["lipsync", "--spec", "tiny", "--audio", "WAV"],
    ["lipsync", "--spec", "tiny", "--audio", "WAV", "--minutes", "0.1"],
    ["compare", "--spec", "tiny", "--a", "reference", "--b", "ring-fp32", "--clips", "2", "--clip-seconds", "2"],
    ["drift", "--spec", "tiny", "--minutes", "0.1", "--audio", "WAV"],
])
@pytest.mark.parametrize("offset", ["0", "-3"])
def test_max_offset_below_one_is_refused(tmp_path, speech, capsys, argv, offset):
    """0 leaves one correlation (score and confidence always 0); below 0 nothing to search."""
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    argv = [str(wav) if a == "WAV" else a for a in argv]
    assert main([*argv, "--max-offset", offset]) == 2
    assert f"--max-offset must be at least 1 frame, got {offset}" in capsys.readouterr().err


@pytest.mark.parametrize("device, message", [("gpu", "unknown device 'gpu'"), ("cuda:99", "--device cuda:99")])
@pytest.mark.parametrize("command", ["lipsync", "sheet"])
def test_bad_devices_are_named(tmp_path, speech, capsys, command, device, message):
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    argv = ["--spec", "tiny", "--audio", str(wav), "--device", device]
    if command == "sheet":
        argv += ["--out", str(tmp_path / "sheet.png")]
    assert main([command, *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "sheet.png").exists()


@pytest.mark.parametrize("command", ["lipsync", "sheet"])
def test_the_device_is_a_gpu_when_one_is_visible_unless_told(tmp_path, speech, monkeypatch, capsys, command):
    """Like generate, train and the app: without --device, `auto` (a GPU when one is visible)."""
    import lab.quality

    asked = []

    def record(name: str):
        asked.append(name)
        raise ValueError("stop here")

    monkeypatch.setattr(lab.quality, "pick_device", record)
    wav = tmp_path / "x.wav"
    _write_wav(wav, speech[: 3 * SAMPLE_RATE])
    argv = ["--spec", "tiny", "--audio", str(wav)] + (["--out", str(tmp_path / "sheet.png")] if command == "sheet" else [])
    assert main([command, *argv]) == 2
    assert asked == ["auto"]


# Idle: motion, blinks, still windows -------------------------------------------------------------------
IDLE_SIZE = (128, 128)


def test_eye_boxes_hold_the_eyes_at_any_sway():
    from lab.quality import eye_boxes

    for preset in ch.PRESETS:
        states = ch.neutral_state(5)
        states[:, ch.S["dx"]] = torch.tensor([0.0, 0.035, -0.035, 0.0, 0.035])
        states[:, ch.S["dy"]] = torch.tensor([0.0, 0.018, -0.018, 0.018, -0.018])
        states[:, ch.S["tilt"]] = torch.tensor([0.0, 0.05, -0.05, -0.05, 0.05])
        frames = ch.render_states(preset, states, IDLE_SIZE)
        white = ((frames.float() / 255 - torch.tensor(ch.EYE_WHITE)).abs().amax(-1) < 0.03)  # (T, H, W)
        inside = torch.zeros_like(white)
        for y0, y1, x0, x1 in eye_boxes(preset, IDLE_SIZE):
            inside[:, y0:y1, x0:x1] = True
        assert white.any() and not (white & ~inside).any(), preset


def test_blinks_are_found_where_the_renderer_blinked():
    from lab.quality import detect_blinks, eye_whiteness, idle_motion_stats

    n = 24 * 15
    frames, states = ch.render_audio(np.zeros(n * SAMPLE_RATE // 24, np.float32), "kofi", seed=4, size=IDLE_SIZE,
                                     n_frames=n)
    truth = detect_blinks(1.0 - states[:, ch.S["blink"]])
    found = detect_blinks(eye_whiteness(frames, "kofi"))
    assert len(truth) >= 3 and len(found) == len(truth)
    assert all(abs(a - b) <= 2 for a, b in zip(found, truth)), (found, truth)
    stats = idle_motion_stats(frames, "kofi")
    assert stats["blinks"] == len(truth) and stats["blinks_per_minute"] == pytest.approx(len(truth) * 4)
    assert len(stats["motion_per_second"]) == 15 and stats["motion_min_second"] > 0
    assert stats["eye_motion_mean"] > stats["motion_mean"]  # blinks and gaze move the eyes more than the picture
    assert stats["longest_still_s"] < 2.0 and stats["still_windows_over_target"] == 0
    assert len(stats["shift_per_second"]) == 14 and stats["shift_min_second"] > 0.003  # the head sways a lot in 1 s


def test_a_frozen_clip_is_one_long_still_window():
    from lab.quality import idle_motion_stats

    frame = ch.reference_image("ada", IDLE_SIZE)
    frozen = frame[None].expand(72, -1, -1, -1).contiguous()
    stats = idle_motion_stats(frozen, "ada")
    assert stats["longest_still_s"] == pytest.approx(71 / 24) and stats["still_windows_over_target"] == 1
    assert stats["blinks"] == 0 and stats["motion_mean"] == 0.0 and stats["shift_min_second"] == 0.0
    with pytest.raises(ValueError, match="uint8"):
        idle_motion_stats(frozen.float(), "ada")


def test_idle_cli_reports_the_engine_and_the_renderer(capsys):
    assert main(["idle", "--spec", "tiny", "--seconds", "3", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["frames"] == 72 and report["spec"] == "tiny"
    for key in ("generated", "rendered"):
        assert len(report[key]["motion_per_second"]) == 3 and "longest_still_s" in report[key]
    assert "blinks_in_state" in report["rendered"]
    assert main(["idle", "--spec", "tiny", "--seconds", "1", "--device", "cpu"]) == 2
    assert "too short" in capsys.readouterr().err
