"""Training: the teacher-forcing attention equals the session's, the corpus is reproducible, the CLI runs."""

import shutil

import numpy as np
import pytest
import torch

from training import train
from engine.cache import ReferenceKVCache, RingKVCache
from engine.codec import build_codec, load_codec, save_codec
from engine.model import build_model
from engine.session import EngineSession
from training.train import (
    Paused,
    TeacherForcingAttention,
    dit_loss,
    load_corpus,
    main,
    make_corpus,
    save_corpus,
    teacher_forcing_forward,
)
from engine.checkpoint import save_checkpoint
from engine.weights import load_engine
from tests.helpers import TINY


def clip_inputs(B: int, T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    C, (h, w) = TINY.latent_channels, TINY.latent_grid
    ref = torch.randn(B, C, h, w, generator=g)
    ctx = torch.randn(B, T, C, h, w, generator=g)
    tgt = torch.randn(B, T, C, h, w, generator=g)
    levels = torch.tensor([1.0, 0.75, 0.5, 0.25])
    tau = levels[torch.randint(0, 4, (B, T), generator=g)]
    audio = torch.randn(B, T, TINY.audio_window, TINY.n_mels, generator=g)
    return ref, ctx, tgt, tau, audio


@pytest.mark.parametrize("cache", ["reference", "ring"])
def test_training_attention_matches_the_session(cache):
    """Each target frame's training prediction equals the pass the session runs on the same inputs.

    The session's frame t sees the sink and the K/V that frames t-W+1 .. t-1 left from their
    last pass (fed here the context copies at 0.25), whatever the cache: the plain reference
    cache, or the ring with its position resets (tiny spec: every 5 steps).
    """
    model = build_model(TINY, seed=1)
    B, T = 2, 8  # longer than the window (3) and past a position reset
    ref, ctx, tgt, tau, audio = clip_inputs(B, T)
    with torch.no_grad():
        pred = teacher_forcing_forward(model, ref, ctx, tgt, tau, audio, ctx_tau=0.25)
        for b in range(B):
            if cache == "reference":
                kv = ReferenceKVCache(TINY)
            else:
                kv = RingKVCache(TINY, [blk.k_norm.weight for blk in model.blocks],
                                 [blk.v_norm.weight for blk in model.blocks], kv_dtype="fp32")
            model.encode_reference(ref[b], kv.reference_attend)
            for t in range(T):
                kv.begin_step(t)
                v = model(tgt[b, t], tau[b, t], audio[b, t], kv.attend)
                torch.testing.assert_close(pred[b, t], v, atol=1e-4, rtol=0)
                model(ctx[b, t], torch.tensor(0.25), audio[b, t], kv.attend)  # the last pass: what the cache keeps
                kv.end_step()


def test_training_attention_matches_a_session_step():
    """Through EngineSession itself: frame 0's first pass (noise level 1) sees only the sink."""
    model = build_model(TINY, seed=2)
    ref, _, _, _, audio = clip_inputs(1, 1, seed=3)
    session = EngineSession(model, cache="reference", seed=4)
    session.start(ref[0])
    noise = torch.randn((TINY.latent_channels, *TINY.latent_grid), generator=torch.Generator().manual_seed(4))
    window = audio[0, 0]
    session.push_audio_features(window[TINY.audio_context:TINY.audio_context + 4], start_frame=0)
    window = session._audio_window()  # silence before frame 0, as the session sees it
    with torch.no_grad():
        pred = teacher_forcing_forward(model, ref, noise[None, None], noise[None, None], torch.ones(1, 1),
                                       window[None, None], ctx_tau=0.25)[0, 0]
        expected = noise + (0.75 - 1.0) * pred  # the first Euler move
        session.cache.begin_step(0)
        v = model(noise, session.levels[0], window, session.cache.attend)
    torch.testing.assert_close(noise + (session.levels[1] - session.levels[0]) * v, expected, atol=1e-4, rtol=0)


def test_attention_mask_keeps_targets_off_their_context_copy():
    att = TeacherForcingAttention(TINY, T=4, device=torch.device("cpu"), dtype=torch.float32)
    F_, R, W = TINY.frame_tokens, TINY.reference_tokens, TINY.window_frames
    m = att.mask  # (T, 2F, S)
    own_ctx = slice(R + (W - 1) * F_, R + W * F_)
    assert m[:, :F_, own_ctx].all() and not m[:, F_:, own_ctx].any()
    assert not m[0, :, R:R + (W - 1) * F_].any()  # frame 0 has no history
    assert m[3, F_:, R:R + (W - 1) * F_].all()  # frame 3 sees frames 1 and 2


def test_dit_loss_learns_a_fixed_batch():
    torch.manual_seed(0)
    model = build_model(TINY, seed=1).train()
    ref, x0, _, _, audio = clip_inputs(2, 4, seed=5)
    att = TeacherForcingAttention(TINY, 4, torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(40):
        torch.manual_seed(1)  # the same noise every step: a fixed regression problem
        loss = dit_loss(model, x0, ref, audio, [1.0, 0.75, 0.5, 0.25, 0.0], att)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_corpus_is_reproducible(tmp_path):
    a, meta = make_corpus(6.0, seed=3, sources=("synth",))
    b, _ = make_corpus(6.0, seed=3, sources=("synth",))
    c, _ = make_corpus(6.0, seed=4, sources=("synth",))
    assert a.dtype == np.int16 and a.size == 6 * 16000
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert (a == 0).any() and np.abs(a).max() > 3000  # silences and speech
    save_corpus(tmp_path / "c.npz", a, meta)
    pcm, meta2 = load_corpus(tmp_path / "c.npz")
    assert np.array_equal(pcm, a) and meta2["seed"] == 3
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a talkloop speech corpus"):
        load_corpus(tmp_path / "junk.npz")
    with pytest.raises(ValueError, match="unknown corpus sources"):
        make_corpus(1.0, 0, ("festival",))


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_espeak_corpus():
    pcm, meta = make_corpus(4.0, seed=1, sources=("espeak",))
    assert meta["utterances"]["espeak"] >= 1 and np.abs(pcm).max() > 3000


def test_cli_trains_the_tiny_spec_end_to_end(tmp_path, capsys):
    corpus = tmp_path / "speech.npz"
    assert main(["corpus", "--out", str(corpus), "--minutes", "0.25", "--source", "synth"]) == 0
    args = ["--spec", "tiny", "--corpus", str(corpus), "--device", "cpu", "--assets", str(tmp_path / "assets"),
            "--work", str(tmp_path / "work"), "--max-steps", "4"]
    both = ["all", *args, "--codec-batch", "4", "--dit-batch", "2", "--clip", "4", "--variants", "2",
            "--variant-minutes", "0.1", "--compile", "off", "--save-every", "0"]
    # An invocation out of time saves its state and says so; the same command with --resume goes on.
    assert main([*both, "--session-minutes", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert '"event": "paused"' in out and '"event": "session_over"' in out
    assert not (tmp_path / "assets" / "tiny-codec.pt").exists()
    assert main([*both, "--resume"]) == 0
    out = capsys.readouterr().out
    assert '"event": "resumed"' in out and '"event": "saved"' in out and '"phase": "dit"' in out
    assets = tmp_path / "assets"
    for name in ("tiny.pt", "tiny.pt.sha256", "tiny-codec.pt", "tiny-codec.pt.sha256"):
        assert (assets / name).is_file(), name
    assert (tmp_path / "work" / "tiny-dit-latest.pt").is_file()  # intermediate weights
    model, codec, trained = load_engine(TINY, weights=assets / "tiny.pt")
    assert trained and type(codec).__name__ == "TrainedCodec"
    session = EngineSession(model, seed=0)
    session.start(codec.encode_reference(torch.zeros(32, 32, 3, dtype=torch.uint8)))
    assert codec.decode(session.step()).shape == (4, 32, 32, 3)
    # The DiT half alone, resuming from its finished state, reuses the shipped codec and the cached bank.
    assert main(["dit", *args, "--dit-batch", "2", "--clip", "4", "--variants", "2", "--variant-minutes", "0.1",
                 "--compile", "off", "--resume"]) == 0
    out = capsys.readouterr().out
    assert '"event": "resumed"' in out and '"cached": true' in out
    load_codec(TINY, assets / "tiny-codec.pt")
    assert main(["codec", "--spec", "tiny", "--corpus", str(tmp_path / "nope.npz")]) == 2


def test_corpus_is_written_to_the_exact_path_given(tmp_path, capsys):
    out = tmp_path / "speech"  # no .npz: numpy would add one to a bare name
    assert main(["corpus", "--out", str(out), "--minutes", "0.05", "--source", "synth"]) == 0
    assert out.is_file() and not (tmp_path / "speech.npz").exists()
    pcm, meta = load_corpus(out)
    assert pcm.size == 3 * 16000 and meta["seed"] == 0
    assert '"mb"' in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, message", [
    ("--codec-minutes", "0", "--codec-minutes must be positive, got 0"),
    ("--dit-minutes", "-1", "--dit-minutes must be positive, got -1"),
    ("--dit-minutes", "nan", "--dit-minutes must be positive, got nan"),
    ("--session-minutes", "0", "--session-minutes must be positive, got 0"),
    ("--max-steps", "0", "--max-steps must be at least 1, got 0"),
])
def test_budgets_that_allow_no_step_are_refused(tmp_path, capsys, flag, value, message):
    """They would end the phase at once and save freshly initialised weights as the result."""
    assets = tmp_path / "assets"
    argv = ["all", "--spec", "tiny", "--corpus", str(tmp_path / "speech.npz"), "--device", "cpu",
            "--assets", str(assets), "--work", str(tmp_path / "work"), flag, value]
    assert main(argv) == 2
    assert message in capsys.readouterr().err  # named before the corpus is even looked for
    assert not assets.exists()


def test_all_puts_its_codec_in_assets_only_with_its_dit(tmp_path, capsys, monkeypatch):
    """Until the DiT trained on the new codec is saved, --assets keeps its old pair untouched."""
    corpus = tmp_path / "speech.npz"
    assert main(["corpus", "--out", str(corpus), "--minutes", "0.25", "--source", "synth"]) == 0
    assets, work = tmp_path / "assets", tmp_path / "work"
    assets.mkdir()
    save_checkpoint(build_model(TINY, seed=9), TINY, assets / "tiny.pt")  # the pair from an earlier run
    save_codec(build_codec(TINY, seed=9), assets / "tiny-codec.pt")
    old = {p.name: p.read_bytes() for p in assets.iterdir()}
    argv = ["all", "--spec", "tiny", "--corpus", str(corpus), "--device", "cpu", "--assets", str(assets),
            "--work", str(work), "--max-steps", "2", "--codec-batch", "4", "--dit-batch", "2", "--clip", "4",
            "--variants", "2", "--variant-minutes", "0.1", "--compile", "off"]

    def out_of_time(*args, **kwargs):  # the DiT phase pauses (or is killed) after the codec phase ended
        raise Paused("dit")

    real_train_dit = train.train_dit
    monkeypatch.setattr(train, "train_dit", out_of_time)
    assert main(argv) == 0
    assert {p.name: p.read_bytes() for p in assets.iterdir()} == old
    assert (work / "tiny-codec.pt").is_file() and (work / "tiny-codec.pt.sha256").is_file()
    monkeypatch.setattr(train, "train_dit", real_train_dit)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    assert '"event": "already_trained"' in out  # the resumed run found the codec it trained in --work
    for name in ("tiny.pt", "tiny-codec.pt"):
        assert (assets / name).read_bytes() == (work / name).read_bytes() != old[name]
    _, codec, trained = load_engine(TINY, weights=assets / "tiny.pt")
    assert trained and type(codec).__name__ == "TrainedCodec"


def test_codec_audio_new_layers_only_trains_the_mouth_and_nothing_else(tmp_path, capsys):
    """From a listening decoder, `--new-layers-only` trains the per-frame mouth it gains and leaves every other
    weight as it was; from one that has the mouth already there is nothing to train, and it says so."""
    from engine.codec import codec_config

    corpus = tmp_path / "speech.npz"
    assert main(["corpus", "--out", str(corpus), "--minutes", "0.1", "--source", "synth"]) == 0
    init = tmp_path / "init" / "tiny-codec.pt"
    init.parent.mkdir()
    save_codec(build_codec(TINY, seed=3, cfg=codec_config(TINY, audio=True, listen_features=3)), init)
    argv = ["codec-audio", "--spec", "tiny", "--corpus", str(corpus), "--device", "cpu", "--batch", "4",
            "--max-steps", "3", "--new-layers-only", "--work", str(tmp_path / "w")]
    out = tmp_path / "out" / "tiny-codec.pt"
    assert main([*argv, "--init", str(init), "--out", str(out)]) == 0
    before, after = load_codec(TINY, init).state_dict(), load_codec(TINY, out).state_dict()
    gained = [k for k in after if k not in before]
    assert gained and all(k.startswith("decoder.mouth.") for k in gained)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(after[k].abs().sum() > 0 for k in gained if k.endswith("basis.0.weight"))
    capsys.readouterr()
    assert main([*argv, "--init", str(out), "--out", str(tmp_path / "again" / "tiny-codec.pt")]) == 2
    assert "nothing new to train" in capsys.readouterr().err


def test_codec_audio_fine_tunes_a_decoder_that_reads_audio(tmp_path, capsys):
    """`codec-audio` on the tiny spec: from a codec (here untrained), the encoder frozen (the same latents), the
    loss on a fixed batch goes down from the init, the saved file (with its sha256) loads as an audio codec and
    decodes with audio, and a rerun with the same seed writes the same file."""
    import torch.nn.functional as F

    from engine.checkpoint import sha256_of
    from training.train import MOUTH_STATE, FrameSampler, audio_decoder_from, codec_loss, corpus_tracks, face_weights

    torch.set_num_threads(max(torch.get_num_threads(), 2))
    corpus = tmp_path / "speech.npz"
    assert main(["corpus", "--out", str(corpus), "--minutes", "0.25", "--source", "synth"]) == 0
    init = tmp_path / "init" / "tiny-codec.pt"
    init.parent.mkdir()
    save_codec(build_codec(TINY, seed=3), init)
    argv = ["codec-audio", "--spec", "tiny", "--corpus", str(corpus), "--device", "cpu", "--init", str(init),
            "--batch", "8", "--max-steps", "40", "--seed", "1", "--lr", "2e-3", "--new-lr", "3e-3"]
    assert main([*argv, "--out", str(tmp_path / "a" / "tiny-codec.pt"), "--work", str(tmp_path / "wa")]) == 0
    out = capsys.readouterr().out
    assert '"phase": "codec-audio"' in out and '"event": "saved"' in out
    assert main([*argv, "--out", str(tmp_path / "b" / "tiny-codec.pt"), "--work", str(tmp_path / "wb")]) == 0
    a, b = tmp_path / "a" / "tiny-codec.pt", tmp_path / "b" / "tiny-codec.pt"
    assert (tmp_path / "a" / "tiny-codec.pt.sha256").read_text().split()[0] == sha256_of(a) == sha256_of(b)
    base, tuned = load_codec(TINY, init), load_codec(TINY, a)
    assert tuned.cfg.audio_mels == TINY.n_mels and tuned.cfg.audio_context == 1
    image = torch.zeros(32, 32, 3, dtype=torch.uint8)
    assert torch.equal(tuned.encode_reference(image), base.encode_reference(image))  # encoder frozen
    pcm, _ = load_corpus(corpus)
    sampler = FrameSampler(TINY, corpus_tracks(pcm, TINY), seed=99, device=torch.device("cpu"))
    frames, looks, states, rows, heard, source = sampler.sample_with_audio(16, 1, listen=True)
    assert tuned.cfg.listen_features == heard.shape[-1] == 3 and heard.abs().sum() > 0
    hearing = heard.flatten(1).abs().sum(1) > 0
    assert not torch.equal(frames[hearing], source[hearing])  # the encoder sees no listening motion
    weights = face_weights(looks, states, TINY.image_size)
    with torch.no_grad():
        torch.manual_seed(0)
        seeded = audio_decoder_from(base, TINY, listen_features=3, mouth_dims=2)
        before = codec_loss(seeded, frames, weights, 0.0, rows, 1.0, heard, source, states)[0].item()
        torch.manual_seed(0)
        after = codec_loss(tuned, frames, weights, 0.0, rows, 1.0, heard, source, states)[0].item()
        mouths = states[..., MOUTH_STATE]
        guessed = [F.mse_loss(c.decoder.mouth(rows), mouths).item() for c in (seeded, tuned)]
    assert after < 0.8 * before, (before, after)
    assert tuned.cfg.mouth_dims == 2 and guessed[1] < 0.5 * guessed[0], guessed  # each frame's mouth from its audio
    z = tuned.encode_reference(image)
    assert tuned.decode(z, audio=rows[0]).shape == tuned.decode(z, audio=rows[0], listen=heard[0]).shape == (4, 32, 32, 3)
    with torch.no_grad():  # the audio counts, and so does the user's voice
        louder = tuned.decode_frames(z[None], rows[:1] + 0.5) - tuned.decode_frames(z[None], rows[:1])
        heard_one = torch.full((1, 4, 3), 0.8)
        listening = tuned.decode_frames(z[None], rows[:1], heard_one) - tuned.decode_frames(z[None], rows[:1])
    assert louder.abs().max() > 1e-3 and listening.abs().max() > 1e-3


def test_a_tracks_file_trains_as_its_corpus_does(tmp_path, capsys):
    """`tracks` writes the corpus's per-frame tracks (features, mouth, listening rows) for a spec's clock; --corpus
    reads them as it reads the corpus, and a spec with other mel bands is refused by name."""
    from training.train import corpus_tracks, load_tracks

    corpus, tracks_file = tmp_path / "c.npz", tmp_path / "t.npz"
    assert main(["corpus", "--out", str(corpus), "--minutes", "0.2", "--source", "synth"]) == 0
    assert main(["tracks", "--spec", "tiny", "--corpus", str(corpus), "--out", str(tracks_file), "--device", "cpu"]) == 0
    assert '"phase": "tracks"' in capsys.readouterr().out
    pcm, _ = load_corpus(corpus)
    direct, (read, meta) = corpus_tracks(pcm, TINY), load_tracks(tracks_file, TINY)
    assert torch.allclose(read.features, direct.features, atol=2e-3)  # stored as float16
    assert torch.equal(read.mouth, direct.mouth) and torch.equal(read.listening, direct.listening)
    assert read.listening.shape == (direct.n_frames, 3) and meta["seconds"] == 12.0
    with pytest.raises(ValueError, match="mel bands"):
        load_tracks(tracks_file, TINY.with_(n_mels=32))
