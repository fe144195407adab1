"""The lip-sync metric: reads the mouth from pixels, ranks synced above shifted above shuffled."""

import json
import wave

import numpy as np
import pytest
import torch

from engine import character as ch
from engine.audio import SAMPLE_RATE
from engine.quality import (
    audio_envelope,
    main,
    mouth_opening,
    offset_correlations,
    picture_stats,
    shuffled_floor,
    sync_scores,
)
from engine.train import make_corpus

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
    assert {"generated", "ceiling", "floor", "ratio_to_ceiling", "steps_per_second"} <= set(report)
    assert report["frames"] == 72 and report["ceiling"]["score"] > report["floor"]["score"]
    assert main(["lipsync", "--spec", "tiny", "--audio", str(wav), "--json", "--max-offset", "8", "--minutes", "0.1"]) == 0
    long = json.loads(capsys.readouterr().out)
    assert long["per_minute"] and set(long["first_vs_last"]) == {"score", "confidence", "brightness", "sharpness", "ref_diff"}
    assert long["ceiling_first_minute"]["score"] > 0
    assert main(["lipsync", "--spec", "tiny", "--audio", str(tmp_path / "none.wav")]) == 2
    assert main(["lipsync", "--spec", "tiny", "--audio", str(wav), "--preset", "zed"]) == 2


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
