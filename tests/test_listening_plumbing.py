"""The user's voice from the app's microphone to every decode: RealtimeCharacter.listen, the local and the
distributed step seams, and the app's microphone paths."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import engine.realtime
from engine.audio import SAMPLE_RATE, to_mono_16k
from engine.codec import StandInCodec, build_codec, codec_config, decode_step, save_codec
from engine.distributed import DistributedEngine, Placement, _decoder_item
from engine.listen import LISTEN_FEATURES, ListeningTrack
from engine.options import EngineOptions
from engine.realtime import RealtimeCharacter, RemoteSteps
from engine.session import EngineSession
from tests.helpers import TINY, reference_latent, tiny_model

K = TINY.frames_per_latent


def voice(seconds: float, rate: int = SAMPLE_RATE, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def heard_rows(pcm: np.ndarray) -> torch.Tensor:
    track = ListeningTrack(TINY.fps)
    track.push(pcm)
    return track.latest(K)


def listening_codec(seed: int = 1):
    """A listening audio codec whose conditioning shows in its frames (its FiLM layers start as the identity)."""
    codec = build_codec(TINY, seed=seed, cfg=codec_config(TINY, audio=True, listen_features=LISTEN_FEATURES))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for film in (*codec.decoder.film, codec.decoder.frame_film):
            film.proj.weight.copy_(0.5 * torch.randn(film.proj.weight.shape, generator=g))
    return codec.eval()


def local_character(model, codec, **kw) -> RealtimeCharacter:
    session = EngineSession(model, seed=2)
    session.start(reference_latent())
    return RealtimeCharacter(session, codec, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def decoded(monkeypatch):
    """The `listen` rows of every local decode, in order."""
    seen = []

    def spy(codec, latent, window, spec, listen=None):
        seen.append(listen)
        return decode_step(codec, latent, window, spec, listen)

    monkeypatch.setattr(engine.realtime, "decode_step", spy)
    return seen


# (a) The local step seam ----------------------------------------------------------------------------------
def test_each_decode_gets_the_rows_of_the_voice_heard_before_its_step(model, decoded):
    character = local_character(model, StandInCodec(TINY))
    loud = voice(1.0)
    character.listen(loud)
    character.make_step()
    assert decoded[-1].shape == (K, LISTEN_FEATURES) and decoded[-1].device.type == "cpu"
    assert decoded[-1].abs().sum() > 0 and torch.equal(decoded[-1], heard_rows(loud))
    character.listen((loud * 32767).astype(np.int16)[:4000])  # int16 in chunks: the track goes on
    character.make_step()
    track = ListeningTrack(TINY.fps)
    track.push(loud)
    track.push((loud * 32767).astype(np.int16)[:4000])
    assert torch.equal(decoded[-1], track.latest(K))


def test_without_listen_the_rows_are_silence(model, decoded):
    character = local_character(model, StandInCodec(TINY))
    for _ in range(2):
        character.make_step()
    assert len(decoded) == 2 and all(torch.equal(rows, torch.zeros(K, LISTEN_FEATURES)) for rows in decoded)


def test_a_listening_codec_draws_the_voice_and_silence_as_none(model):
    codec = listening_codec()
    quiet, heard = local_character(model, codec), local_character(model, codec)
    heard.listen(voice(1.0))
    a, b = quiet.make_step(), heard.make_step()
    assert max(np.abs(x.rgb.astype(int) - y.rgb.astype(int)).max() for x, y in zip(a, b)) > 8
    z, window = torch.randn(TINY.latent_channels, *TINY.latent_grid), torch.randn(TINY.audio_window, TINY.n_mels)
    silent = decode_step(codec, z, window, TINY, torch.zeros(K, LISTEN_FEATURES))  # no listen(): zero rows
    assert torch.equal(silent, decode_step(codec, z, window, TINY, None))  # the codec's own silence


# (b) The distributed decoder path -------------------------------------------------------------------------
def test_the_decoder_queue_item_carries_the_rows_on_the_cpu():
    latent, window, rows = torch.zeros(2), torch.ones(3), heard_rows(voice(0.5)).double()
    index, got_latent, got_window, got_rows, ms = _decoder_item(5, latent, window, rows, 12.5)
    assert (index, ms) == (5, 12.5) and got_latent is latent and torch.equal(got_window, window)
    assert got_rows.dtype == torch.float32 and got_rows.device.type == "cpu" and torch.equal(got_rows, rows.float())
    assert _decoder_item(0, latent, window, None, 1.0)[3] is None


def test_a_decoder_process_decodes_with_the_rows_the_character_heard(model, tmp_path):
    """RealtimeCharacter on the distributed engine (one gloo rank, a decoder process) listening to the user:
    the frames equal the local character's, which heard the same, and differ from a silent one's."""
    from engine.checkpoint import save_checkpoint

    save_checkpoint(model, TINY, tmp_path / "tiny.pt")
    codec = listening_codec()
    save_codec(codec, tmp_path / "tiny-codec.pt")
    loud = voice(1.0)
    steps = 3

    def run(character, listen: bool) -> list:
        if listen:
            character.listen(loud)
        got = []
        while len(got) < steps * K:
            got += character.make_step()
        return got

    local, silent = run(local_character(model, codec), True), run(local_character(model, codec), False)
    with DistributedEngine(TINY, Placement(cpu_ranks=1), EngineOptions(weights=str(tmp_path / "tiny.pt"), seed=2),
                           timeout=120) as engine:
        remote_steps = RemoteSteps(engine)
        remote_steps.start(reference_latent())
        remote = run(RealtimeCharacter(steps=remote_steps, lookahead=1), True)
    diff = lambda xs, ys: max(np.abs(x.rgb.astype(int) - y.rgb.astype(int)).max() for x, y in zip(xs, ys))
    assert [f.index for f in remote] == list(range(steps * K))
    assert diff(remote, local) <= 1
    assert diff(local, silent) > 8  # the rows show: the comparison has teeth


# (c) The app's microphone --------------------------------------------------------------------------------
class Listener:
    """A character as LiveSession sees it, keeping what it hears."""

    def __init__(self) -> None:
        self.track = ListeningTrack(TINY.fps)
        self.chunks: list[np.ndarray] = []

    def listen(self, pcm: np.ndarray) -> None:
        self.chunks.append(pcm)
        self.track.push(pcm)

    def stop(self, session_log=None) -> dict:
        return {}


def test_the_session_hands_the_microphone_to_the_character_at_16_khz():
    from app.live import LiveSession

    live = LiveSession(Listener(), None, "ada")  # no voice models: the character listens all the same
    stereo = np.stack([voice(0.5, 48000), voice(0.5, 48000)], axis=1)
    live.feed_mic(stereo, 48000)
    live.feed_mic(voice(0.25), SAMPLE_RATE)
    heard = live.character.chunks
    assert [c.shape for c in heard] == [(8000,), (4000,)] and all(c.dtype == np.float32 for c in heard)
    assert torch.equal(live.character.track.latest(K), heard_rows(np.concatenate([to_mono_16k(stereo, 48000),
                                                                                  voice(0.25)])))
    with pytest.raises(ValueError):
        live.feed_mic(np.full(320, np.nan, np.float32), SAMPLE_RATE)
    live.stop(None)
    live.feed_mic(voice(0.25), SAMPLE_RATE)  # a session being replaced hears nothing more
    assert len(heard) == 2


def test_the_browser_microphone_reaches_a_real_character(model):
    """The WebRTC reader (48 kHz frames, resampled to 16 kHz) -> LiveSession.feed_mic -> RealtimeCharacter.listen."""
    import av
    from aiortc.mediastreams import MediaStreamError

    from app.live import LiveSession
    from app.rtc import Peer

    class Microphone:  # the browser's track: 20 ms frames at 48 kHz of a loud tone, then the connection closes
        def __init__(self, frames: int) -> None:
            self.left, self.read = frames, 0
            self.pcm = (voice(frames * 0.02, 48000) * 32767).astype(np.int16)

        async def recv(self) -> av.AudioFrame:
            if self.left == 0:
                raise MediaStreamError
            self.left -= 1
            chunk = self.pcm[960 * self.read:960 * (self.read + 1)]
            frame = av.AudioFrame.from_ndarray(chunk[None], format="s16", layout="mono")
            frame.sample_rate, frame.pts = 48000, 960 * self.read
            self.read += 1
            return frame

    character = local_character(model, StandInCodec(TINY))
    live = LiveSession(character, None, "ada")
    assert torch.equal(character.listening.latest(K), torch.zeros(K, LISTEN_FEATURES))
    asyncio.run(asyncio.wait_for(Peer._read_mic(SimpleNamespace(live=live), Microphone(frames=25)), 10))
    rows = character.listening.latest(K)
    assert character.listening.frames >= 10 and (rows[:, 0] > 0.5).all()  # half a second of a loud voice, heard


def test_the_local_microphone_feeds_the_session(monkeypatch, tmp_path):
    """`--audio-input local`: the controller's microphone callback is the session's feed_mic."""
    from app.controller import Controller

    fed = []

    class Mic:
        def __init__(self, feed):
            feed(voice(0.1), SAMPLE_RATE)
            fed.append(feed)

    monkeypatch.setattr("app.local_mic.LocalMicrophone", Mic)
    controller = Controller.__new__(Controller)
    live = SimpleNamespace(feed_mic=lambda pcm, rate: None)
    controller._start_local_mic(live)
    assert fed == [live.feed_mic] and controller.local_mic is not None
