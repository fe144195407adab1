"""Listening: the user's voice as rows per frame (engine.listen), the renderer's listening motion
(engine.character.listen) and the lab's measure of it (lab.quality listen)."""

import json
import wave

import numpy as np
import pytest
import torch

from engine import character as ch
from engine.audio import SAMPLE_RATE
from engine.listen import (
    LISTEN_FEATURES,
    ListeningTrack,
    listening_features,
    silent_rows,
)
from lab.quality import listening_scores, listening_signal, main


def speech_and_pauses(seconds: float = 8.0, seed: int = 0) -> np.ndarray:
    """Noise bursts of 0.6-1.5 s (a voice) between silences of 0.4-1.2 s."""
    rng = np.random.default_rng(seed)
    out, n = [], int(seconds * SAMPLE_RATE)
    while sum(x.size for x in out) < n:
        out.append(0.3 * rng.standard_normal(int(rng.uniform(0.6, 1.5) * SAMPLE_RATE)).astype(np.float32))
        out.append(np.zeros(int(rng.uniform(0.4, 1.2) * SAMPLE_RATE), np.float32))
    return np.concatenate(out)[:n]


def test_the_track_fed_in_any_chunks_equals_the_whole_clip():
    pcm = speech_and_pauses(4.0)
    whole = listening_features(pcm)
    assert whole.shape == (96, LISTEN_FEATURES)
    track = ListeningTrack(keep=8)
    rng = np.random.default_rng(1)
    parts, i = [], 0
    while i < pcm.size:
        k = int(rng.integers(1, 3000))
        parts.append(track.push((pcm[i:i + k] * 32767).astype(np.int16) if i % 2 else pcm[i:i + k]))
        i += k
    assert torch.allclose(torch.cat(parts), whole, atol=1e-3)  # int16 chunks round the samples
    assert track.frames == 96 and torch.allclose(track.latest(4), whole[-4:], atol=1e-3)
    assert torch.equal(ListeningTrack().latest(3), silent_rows(3))  # nothing heard: silence


def test_the_rows_follow_the_voice():
    pcm = np.concatenate([np.zeros(SAMPLE_RATE, np.float32), 0.3 * np.ones(2 * SAMPLE_RATE, np.float32),
                          np.zeros(2 * SAMPLE_RATE, np.float32)])
    rows = listening_features(pcm)
    voice, engaged, pause = rows.unbind(1)
    assert voice[:24].max() == 0 and voice[60] > 0.8 and engaged[60] < voice[60]  # engaged is the slower one
    assert pause[:70].max() < 0.05 and pause[72 + 12] > 0.3  # the pause shows once the voice has stopped
    assert torch.all((rows >= 0) & (rows <= 1))


def test_bad_listening_audio_is_refused():
    with pytest.raises(ValueError, match="1-D"):
        ListeningTrack().push(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        ListeningTrack().push(np.array([0.0, np.nan], np.float32))


def test_listening_motion_moves_nod_brows_smile_and_gaze_and_silence_changes_nothing():
    states = ch.frame_states(ch.mouth_from_audio(np.zeros(SAMPLE_RATE, np.float32)), seed=3)
    assert torch.equal(ch.listen(states, silent_rows(states.shape[0])), states)
    heard = ch.listen(states, torch.tensor([[1.0, 1.0, 1.0]]).expand(states.shape[0], 3))
    S = ch.S
    assert torch.allclose(heard[:, S["dy"]] - states[:, S["dy"]], torch.full((24,), ch.NOD))
    assert torch.all(heard[:, S["brow"]] == 1) and torch.all(heard[:, S["smile"]] == 1)
    assert heard[:, S["gaze_x"]].abs().max() < states[:, S["gaze_x"]].abs().max()
    rest, moved = ch.render_states("kofi", states[:1], (64, 64)), ch.render_states("kofi", heard[:1], (64, 64))
    assert (rest.int() - moved.int()).abs().max() > 40  # visible


def test_the_listening_score_tells_motion_that_follows_the_voice_from_chance():
    pcm = speech_and_pauses(10.0, seed=2)
    n = 240
    signal = listening_signal(pcm, n)
    follows = 0.002 * (signal - signal.min()) + 1e-4 * torch.rand(n, generator=torch.Generator().manual_seed(0))
    unrelated = torch.rand(n, generator=torch.Generator().manual_seed(1))
    good, chance = listening_scores(follows, signal), listening_scores(unrelated, signal)
    assert good["above_shuffled"] and good["corr"] > 0.9
    assert not chance["above_shuffled"]


def _write_wav(path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes())


def test_cli_the_shipped_cpu_character_listens_and_a_codec_without_the_stream_does_not(tmp_path, capsys):
    wav = tmp_path / "user.wav"
    _write_wav(wav, speech_and_pauses(6.0, seed=4))
    assert main(["listen", "--spec", "tiny", "--audio", str(wav), "--json", "--device", "cpu"]) == 0
    tiny = json.loads(capsys.readouterr().out)  # the stand-in codec hears nothing
    assert tiny["generated"]["mean_change"] == 0 and tiny["rendered"]["above_shuffled"]
    sheet = tmp_path / "listen.png"
    assert main(["listen", "--spec", "demo-cpu", "--audio", str(wav), "--json", "--device", "cpu",
                 "--sheet", str(sheet)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trained_weights"] and report["generated"]["above_shuffled"], report["generated"]
    assert report["generated"]["mean_change"] > 0.001 and sheet.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["listen", "--spec", "tiny", "--audio", str(tmp_path / "none.wav")]) == 2
    short = tmp_path / "short.wav"
    _write_wav(short, speech_and_pauses(2.0))
    assert main(["listen", "--spec", "tiny", "--audio", str(short)]) == 2
