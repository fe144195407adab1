"""The trained codec: seam shapes, a round trip on renderer frames, checksums and the size budget."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import character as ch
from engine.checkpoint import save_checkpoint
from engine.codec import StandInCodec, build_codec, codec_config, load_codec, save_codec
from engine.config import get_spec
from engine.model import build_model, count_parameters
from training.train import FrameSampler, Tracks, codec_psnr, train_codec
from engine.weights import ASSETS, load_engine
from tests.helpers import TINY

DEMO = get_spec("demo")
TINY_PSNR_DB = 18.0  # 300 CPU steps at 32x32 measure about 20-21 dB
SHIPPED_PSNR_DB = 28.0


def synthetic_tracks(n: int = 2000, seed: int = 0) -> Tracks:
    """Mouth tracks without audio: smooth random openings and roundness."""
    g = torch.Generator().manual_seed(seed)
    mouth = torch.nn.functional.avg_pool1d(torch.rand(1, 2, n + 4, generator=g), 5, 1).squeeze(0).T
    return Tracks(features=torch.zeros(n, TINY.n_mels), mouth=mouth.contiguous(), listening=torch.zeros(n, 3))


def test_seam_shapes_and_errors():
    codec = build_codec(TINY)
    out = codec.decode(torch.randn(TINY.latent_channels, *TINY.latent_grid))
    assert out.shape == (4, 32, 32, 3) and out.dtype == torch.uint8
    z = codec.encode_reference(ch.reference_image("ada", TINY.image_size))
    assert z.shape == (TINY.latent_channels, *TINY.latent_grid) and torch.isfinite(z).all()
    with pytest.raises(ValueError, match="latent must have shape"):
        codec.decode(torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="reference image must be"):
        codec.encode_reference(torch.zeros(16, 16, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        codec.encode_reference(torch.full((32, 32, 3), float("nan")))


def test_round_trip_on_renderer_frames(tmp_path):
    torch.set_num_threads(max(torch.get_num_threads(), 2))
    tracks = synthetic_tracks()
    codec = train_codec(TINY, tracks, minutes=5.0, device=torch.device("cpu"), out=tmp_path / "tiny-codec.pt",
                        work=tmp_path, batch=16, max_steps=300, latent_noise=0.0)
    frames, _, _ = FrameSampler(TINY, synthetic_tracks(seed=1), seed=7, device=torch.device("cpu")).sample(24)
    psnr = codec_psnr(codec, frames)
    untrained = codec_psnr(build_codec(TINY, seed=3), frames)
    assert psnr > TINY_PSNR_DB, psnr
    assert psnr > untrained + 6.0


@pytest.mark.skipif(not (ASSETS / "demo-codec.pt").is_file(), reason="no shipped demo codec")
def test_shipped_codec_round_trip():
    """The shipped decoder reads each frame's audio: the round trip gets the rows of the audio the mouths came from."""
    from engine.mel import log_mel_frames

    codec = load_codec(DEMO, ASSETS / "demo-codec.pt")
    pcm = torch.randn(16000, generator=torch.Generator().manual_seed(0)) * 0.2
    states = ch.frame_states(ch.mouth_from_audio(pcm), seed=2)[:8]
    frames = torch.stack([ch.render(ch.look_vectors(p), states, DEMO.image_size).unflatten(0, (2, 4)) for p in ch.PRESETS]).flatten(0, 1)
    ctx = codec.audio_context
    rows = torch.stack([log_mel_frames(pcm, DEMO.n_mels, 4 * g - ctx, 4 + 2 * ctx) for g in range(2)])
    assert codec.cfg.audio_mels == DEMO.n_mels and codec.listen_features == 3
    assert codec_psnr(codec, frames, rows.repeat(len(ch.PRESETS), 1, 1)) > SHIPPED_PSNR_DB


def test_checksum_failure_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny-codec.pt"
    save_codec(build_codec(TINY, seed=1), path)
    load_codec(TINY, path)  # intact: loads
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="fails its sha256 check"):
        load_codec(TINY, path)
    with pytest.raises(ValueError, match="not found"):
        load_codec(TINY, tmp_path / "missing.pt")


def test_checkpoint_for_another_shape_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    save_codec(build_codec(TINY), path)
    other = TINY.with_(latent_channels=8)
    with pytest.raises(ValueError, match="latent_channels"):
        load_codec(other, path)


def test_load_engine_picks_up_the_codec_beside_the_weights(tmp_path):
    save_checkpoint(build_model(TINY, seed=2), TINY, tmp_path / "tiny.pt")
    codec = build_codec(TINY, seed=4)
    save_codec(codec, tmp_path / "tiny-codec.pt")
    model, loaded, trained = load_engine(TINY, weights=tmp_path / "tiny.pt")
    assert trained and type(loaded).__name__ == "TrainedCodec"
    z = torch.randn(TINY.latent_channels, *TINY.latent_grid)
    assert torch.equal(loaded.decode(z), load_codec(TINY, tmp_path / "tiny-codec.pt").decode(z))
    # Stored in bf16, so the weights are the original's rounded to bf16.
    w, w0 = loaded.decoder.stem.weight, codec.decoder.stem.weight
    assert torch.equal(w, w0.to(torch.bfloat16).float()) and (w - w0).abs().max() > 0


def test_demo_weights_fit_the_budget():
    codec_params = sum(p.numel() for p in build_codec(DEMO).parameters())
    total_mb = 2 * (codec_params + count_parameters(DEMO)) / 1e6  # both stored in bf16
    assert total_mb < 40.0, total_mb
    cfg = codec_config(DEMO)
    assert cfg.latent_grid == (16, 16) and cfg.image_size == (256, 256)


def test_demo_codec_shapes():
    codec = build_codec(DEMO)
    z = codec.encode_reference(ch.reference_image("mika", DEMO.image_size))
    assert z.shape == (16, 16, 16)
    assert codec.decode(z).shape == (4, 256, 256, 3)
    assert Path(codec_config(DEMO).name).name == "demo-codec"


# The audio-conditioned decoder -----------------------------------------------------------------------------
def audio_codec(spec=TINY, seed: int = 5, scale: float = 0.5, **changes):
    """An audio codec whose FiLM layers are random (not the zero start), so the audio changes what it decodes."""
    codec = build_codec(spec, seed=seed, cfg=codec_config(spec, audio=True, **changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for film in codec.decoder.film:
            film.proj.weight.copy_(scale * torch.randn(film.proj.weight.shape, generator=g))
    return codec


def test_an_audio_free_codec_records_its_config_as_before():
    assert set(codec_config(TINY).to_dict()) == {"name", "image_size", "latent_channels", "latent_grid", "frames_per_latent",
                                                "enc_widths", "dec_widths", "latent_blocks"}
    cfg = codec_config(DEMO, audio=True)
    assert (cfg.audio_mels, cfg.audio_context, cfg.audio_rows) == (32, 1, 6)
    assert {"audio_mels", "audio_context", "audio_embed"} <= set(cfg.to_dict())


def test_decode_takes_audio_only_where_the_codec_reads_it():
    z = torch.randn(TINY.latent_channels, *TINY.latent_grid)
    rows = torch.randn(6, TINY.n_mels)
    plain, stand_in = build_codec(TINY, seed=1), StandInCodec(TINY)
    assert torch.equal(plain.decode(z, audio=rows), plain.decode(z))  # accepted, ignored
    assert torch.equal(stand_in.decode(z, audio=rows), stand_in.decode(z))
    codec = audio_codec()
    with pytest.raises(ValueError, match="audio-conditioned"):
        codec.decode(z)
    with pytest.raises(ValueError, match=r"audio must have shape \(6, 16\)"):
        codec.decode(z, audio=torch.randn(4, TINY.n_mels))
    with pytest.raises(ValueError, match="NaN"):
        codec.decode(z, audio=torch.full((6, TINY.n_mels), float("nan")))
    out = codec.decode(z, audio=rows)
    assert out.shape == (4, 32, 32, 3) and not torch.equal(out, codec.decode(z, audio=rows.flip(0)))
    with pytest.raises(ValueError, match="audio-conditioned"):
        codec.decode_frames(z[None])


def test_an_audio_decoder_starts_as_the_decoder_it_is_built_on():
    from training.train import audio_decoder_from

    base = build_codec(TINY, seed=3)
    codec = audio_decoder_from(base, TINY)
    z = torch.randn(TINY.latent_channels, *TINY.latent_grid)
    for rows in (torch.randn(6, TINY.n_mels), torch.zeros(6, TINY.n_mels)):
        assert torch.equal(codec.decode(z, audio=rows), base.decode(z))
    assert torch.equal(codec.encode_reference(ch.reference_image("ada", TINY.image_size)),
                       base.encode_reference(ch.reference_image("ada", TINY.image_size)))


@pytest.mark.skipif(not (ASSETS / "demo-cpu-codec.pt").is_file(), reason="no shipped demo-cpu codec")
def test_the_shipped_codec_reads_audio_and_the_user_and_an_audio_free_one_seeds_an_identical_audio_decoder(tmp_path):
    from training.train import audio_decoder_from

    spec = get_spec("demo-cpu")
    shipped = load_codec(spec, ASSETS / "demo-cpu-codec.pt")
    assert shipped.cfg == codec_config(spec, audio=True, listen_features=3, mouth_dims=2)
    save_codec(build_codec(spec, seed=5), tmp_path / "demo-cpu-codec.pt")  # an audio-free codec, as trained first
    base = load_codec(spec, tmp_path / "demo-cpu-codec.pt")
    assert base.cfg.audio_mels == 0 and base.cfg == codec_config(spec)
    codec = audio_decoder_from(base, spec, listen_features=3, mouth_dims=2)
    z = base.encode_reference(ch.reference_image("kofi", spec.image_size))
    # The same weights, the output convolution run per frame (grouped): equal to within one level of 255 in
    # a few pixels (float summation order), and equal whatever the audio (and the mouth it predicts) or the user's voice.
    seeded = codec.decode(z, audio=torch.randn(6, spec.n_mels), listen=torch.rand(4, codec.listen_features)).int()
    assert (seeded - base.decode(z).int()).abs().max() <= 1
    assert torch.equal(seeded, codec.decode(z, audio=torch.randn(6, spec.n_mels)).int())


def test_a_per_frame_mouth_adds_each_frames_departure_from_the_group_mean():
    codec = audio_codec(mouth_dims=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        basis = codec.decoder.mouth.basis[0].weight
        basis.copy_(0.1 * torch.randn(basis.shape, generator=g))
    z, rows = torch.randn(1, TINY.latent_channels, *TINY.latent_grid), torch.randn(1, 6, TINY.n_mels)
    held = torch.full((1, 4, 2), 0.3)
    moving = torch.tensor([[[0.0, 0.5], [0.2, 0.5], [0.6, 0.3], [0.2, 0.7]]])
    with torch.no_grad():
        base, moved = codec.decode_frames(z, rows, mouth=held), codec.decode_frames(z, rows, mouth=moving)
        change = moved - base
        assert change.abs().max() > 1e-3 and (change[:, 0] - change[:, 2]).abs().max() > 1e-3
        # a frame whose mouth is the group's mean draws nothing, and opening draws other pixels than closing
        level = torch.tensor([[[0.0, 0.5], [0.6, 0.5], [0.3, 0.5], [0.3, 0.5]]])
        drawn = codec.decode_frames(z, rows, mouth=level) - base
        assert drawn[:, 2:].abs().max() < 1e-6 and not torch.allclose(drawn[:, 1], -drawn[:, 0], atol=1e-4)
        # a mouth held over the group draws nothing: the same as a decoder whose basis is zero
        codec.decoder.mouth.basis[0].weight.zero_()
        assert torch.allclose(codec.decode_frames(z, rows, mouth=moving), base, atol=1e-6)
        # without mouths given, the ones the audio predicts
        assert torch.equal(codec.decode_frames(z, rows), codec.decode_frames(z, rows, mouth=codec.decoder.mouth(rows)))
    with pytest.raises(ValueError, match=r"mouths must be \(1, 4, 2\)"):
        codec.decode_frames(z, rows, mouth=torch.zeros(1, 4, 3))
    with pytest.raises(ValueError, match="needs an audio decoder"):
        codec_config(TINY, mouth_dims=2)
    assert "mouth_dims" not in codec_config(DEMO, audio=True).to_dict()  # checkpoints without one load as before


def test_an_audio_decoder_that_gains_a_mouth_decodes_as_before():
    from training.train import audio_decoder_from

    listening = audio_codec(listen_features=3)
    codec = audio_decoder_from(listening, TINY, listen_features=3, mouth_dims=2)
    assert codec.cfg == replace(listening.cfg, mouth_dims=2)
    z, rows, heard = torch.randn(TINY.latent_channels, *TINY.latent_grid), torch.randn(6, TINY.n_mels), torch.rand(4, 3)
    assert torch.equal(codec.decode(z, audio=rows, listen=heard), listening.decode(z, audio=rows, listen=heard))
    with pytest.raises(ValueError, match="start from the audio-free codec"):
        audio_decoder_from(codec, TINY, listen_features=3)  # a layer it has is not dropped


def test_an_audio_codec_checkpoint_loads_as_one(tmp_path):
    codec = audio_codec(audio_context=0, audio_embed=8)
    save_codec(codec, tmp_path / "tiny-codec.pt")
    loaded = load_codec(TINY, tmp_path / "tiny-codec.pt")
    assert (loaded.cfg.audio_mels, loaded.cfg.audio_context, loaded.cfg.audio_embed) == (TINY.n_mels, 0, 8)
    z, rows = torch.randn(TINY.latent_channels, *TINY.latent_grid), torch.randn(4, TINY.n_mels)
    again = load_codec(TINY, tmp_path / "tiny-codec.pt")
    assert torch.equal(loaded.decode(z, audio=rows), again.decode(z, audio=rows))
    w, w0 = loaded.decoder.film[0].proj.weight, codec.decoder.film[0].proj.weight
    assert torch.equal(w, w0.to(torch.bfloat16).float())
    # another shape's audio codec is still refused by its shape
    with pytest.raises(ValueError, match="latent_channels"):
        load_codec(TINY.with_(latent_channels=8), tmp_path / "tiny-codec.pt")


def test_decode_step_cuts_the_frames_rows_from_the_step_window():
    from engine.codec import decode_step, step_audio_rows

    window = torch.arange(DEMO.audio_window, dtype=torch.float32)[:, None].expand(-1, DEMO.n_mels)  # row i: frame first-2+i
    assert step_audio_rows(window, DEMO, 0)[:, 0].tolist() == [2, 3, 4, 5]  # the step's own 4 frames
    assert step_audio_rows(window, DEMO, 1)[:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="within the step"):
        step_audio_rows(window, DEMO, 3)
    with pytest.raises(ValueError, match="rows"):
        step_audio_rows(window[:5], DEMO, 1)
    codec = audio_codec(audio_context=0)
    z = torch.randn(TINY.latent_channels, *TINY.latent_grid)
    win = torch.randn(TINY.audio_window, TINY.n_mels)
    assert torch.equal(decode_step(codec, z, win, TINY), codec.decode(z, audio=win[1:5]))
    assert torch.equal(decode_step(StandInCodec(TINY), z, None, TINY), StandInCodec(TINY).decode(z))
    with pytest.raises(ValueError, match="audio window"):
        decode_step(codec, z, None, TINY)


def test_the_audio_layers_are_a_small_share_of_the_decoder():
    plain = sum(p.numel() for p in build_codec(DEMO).decoder.parameters())
    audio = sum(p.numel() for p in build_codec(DEMO, cfg=codec_config(DEMO, audio=True)).decoder.parameters())
    assert 0 < audio - plain < 0.08 * plain, (plain, audio)
