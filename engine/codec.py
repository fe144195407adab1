"""The codec: 4 RGB frames <-> one latent frame.

`Codec` is what the engine asks of one: `decode(latent, audio) -> (4, H, W, 3) uint8` and
`encode_reference(image) -> latent`, the frame a session starts from. Two implement it:
`TrainedCodec`, loaded from a checkpoint, and `StandInCodec` (right shapes, no training:
a fixed random per-pixel projection, upsampled) for tests and for a DiT run without one.

The trained encoder stacks a latent frame's 4 video frames as 12 input channels and halves
the resolution until it reaches the latent grid (16x for the demo spec: 4x256x256x3 ->
16x16x16); the decoder mirrors it and emits the 4 frames at once. Latents leave the
encoder through a BatchNorm without affine terms, so each channel has zero mean and
unit variance over the training data: the scale the DiT's noise assumes.

A single picture (the session's reference) is encoded as that picture held for 4
frames.

An audio-conditioned decoder (`CodecConfig.audio_mels` > 0) also reads the log-mel rows of
its 4 frames (the engine's per-video-frame features, `engine.mel`), with `audio_context`
frames either side: a small MLP embeds each frame's rows; the 4 embeddings together set a
scale and shift per channel (FiLM) after the latent blocks and each up-sampling stage but
the last, and each frame's own embedding modulates its own copy of the output features,
which that frame's slice of the output convolution draws (a grouped convolution with the
same weights). The latent holds a group of 4 frames nearly as one picture; the audio lets
the mouth change from frame to frame and follow each frame's own sound. The FiLM layers
start at zero, so an audio decoder initialised from an audio-free one decodes as it did
until it is trained (to float summation order: the grouped output convolution adds in
another order). `decode_step` cuts the rows a codec
reads from a step's audio window (the DiT's), for the engine's local and remote decoders.

With `listen_features` > 0 the audio decoder has a second, weaker stream: the rows of the
user's voice for its 4 frames (`engine.listen`), embedded by a smaller MLP and joined to the
speech embedding before the FiLM layers. It draws the listening motion (nods, brows, mouth
corners, gaze) that the renderer's training frames show while the user speaks; rows of
silence (zeros) leave the picture as the speech alone makes it.

With `mouth_dims` > 0 the audio decoder also predicts each frame's mouth (opening, roundness)
from its rows and adds a learnt per-pixel change for each frame's departure from the group's
mean mouth (`FrameMouth`): the lips move at 24 Hz, not at the latent's 6.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import load_checkpoint, save_checkpoint
from engine.config import ModelSpec


class Codec(Protocol):
    """What the engine asks of a codec (the realtime loop, the decoder processes, generate)."""

    spec: ModelSpec
    audio_mels: int  # 0: decode ignores audio
    audio_context: int  # audio frames read either side of the 4

    def decode(self, latent: torch.Tensor, audio: torch.Tensor | None = None,
               listen: torch.Tensor | None = None) -> torch.Tensor: ...  # (C, h, w) -> (4, H, W, 3) uint8

    def encode_reference(self, image: torch.Tensor) -> torch.Tensor: ...  # (H, W, 3) uint8 -> (C, h, w)


def check_image(image: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """A reference picture (H, W, 3), uint8 or float in [0, 1] -> (3, H, W) float; clear errors for anything else."""
    if not isinstance(image, torch.Tensor) or image.ndim != 3 or image.shape[-1] != 3:
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"reference image must be (H, W, 3), got {shape}")
    if image.dtype == torch.uint8:
        image = image.float() / 255.0
    if not torch.isfinite(image).all():
        raise ValueError("reference image contains NaN or infinite values")
    return image.permute(2, 0, 1)  # (3, H, W) in [0, 1]


def step_audio_rows(window: torch.Tensor, spec: ModelSpec, context: int) -> torch.Tensor:
    """The rows of a step's audio window (audio_window, n_mels: video frames first - spec.audio_context on, as
    the DiT gets it) that a decoder with `context` frames either side reads: frames first - context ..
    first + frames_per_latent + context - 1."""
    if not 0 <= context <= spec.audio_context:
        raise ValueError(f"a decoder's audio context ({context}) must lie within the step's ({spec.audio_context})")
    if window.ndim != 2 or window.shape[0] != spec.audio_window:
        raise ValueError(f"a step's audio window must have {spec.audio_window} rows, got shape {tuple(window.shape)}")
    lo = spec.audio_context - context
    return window[lo:lo + spec.frames_per_latent + 2 * context]


def decode_step(codec: Codec, latent: torch.Tensor, window: torch.Tensor | None, spec: ModelSpec,
                listen: torch.Tensor | None = None) -> torch.Tensor:
    """One step's frames: the codec decodes `latent` with the rows of the step's audio `window` it reads
    (an audio-free codec is called with the latent alone), and a listening codec with `listen`, the rows
    (4, LISTEN_FEATURES) of the user's voice for these frames (None: the user is silent)."""
    if not getattr(codec, "audio_mels", 0):
        return codec.decode(latent)
    if window is None:
        raise ValueError("this codec is audio-conditioned: the step's audio window must come with its latent")
    return codec.decode(latent, audio=step_audio_rows(window, spec, codec.audio_context), listen=listen)


class StandInCodec(nn.Module):
    """Right shapes, no training: the codec of tests, and of a DiT loaded without a trained codec beside it.
    It takes no audio: `decode` accepts and ignores it."""

    audio_mels = 0
    audio_context = 0
    listen_features = 0

    def __init__(self, spec: ModelSpec, seed: int = 0):
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        c, k = spec.latent_channels, spec.frames_per_latent
        self.register_buffer("to_rgb", torch.randn(k * 3, c, generator=g) / c**0.5)
        self.register_buffer("to_latent", torch.randn(c, 3, generator=g))

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, audio: torch.Tensor | None = None,
               listen: torch.Tensor | None = None) -> torch.Tensor:
        k = self.spec.frames_per_latent
        rgb = torch.einsum("oc,chw->ohw", self.to_rgb.to(latent), latent)  # (4*3, h, w)
        rgb = F.interpolate(rgb[None].float(), size=self.spec.image_size, mode="bilinear", align_corners=False)[0]
        rgb = torch.sigmoid(rgb).reshape(k, 3, *self.spec.image_size).permute(0, 2, 3, 1)
        return (rgb * 255).round().to(torch.uint8)

    @torch.no_grad()
    def encode_reference(self, image: torch.Tensor) -> torch.Tensor:
        x = check_image(image, self.spec).to(self.to_latent)
        x = F.interpolate(x[None], size=self.spec.latent_grid, mode="area")[0]  # (3, h, w)
        return torch.einsum("cr,rhw->chw", self.to_latent, x * 2 - 1)


@dataclass(frozen=True)
class CodecConfig:
    name: str
    image_size: tuple[int, int]
    latent_channels: int
    latent_grid: tuple[int, int]
    frames_per_latent: int
    enc_widths: tuple[int, ...]  # one per resolution level, image resolution first
    dec_widths: tuple[int, ...]  # latent resolution up to half the image's; the last step is a pixel shuffle
    latent_blocks: int = 2  # residual blocks at the latent resolution in the decoder
    audio_mels: int = 0  # log-mel bands of each frame's audio the decoder reads; 0: no audio (the original decoder)
    audio_context: int = 0  # frames of audio either side of each decoded frame
    audio_embed: int = 32  # width of one frame's audio embedding (with audio_mels > 0)
    listen_features: int = 0  # rows per frame of the user's voice (engine.listen) an audio decoder reads; 0: none
    listen_embed: int = 16  # width of the 4 frames' listening embedding (with listen_features > 0)
    mouth_dims: int = 0  # per-frame mouth values (opening, roundness) an audio decoder predicts and draws; 0: none

    def __post_init__(self) -> None:
        n = self.levels
        if len(self.enc_widths) != n + 1 or len(self.dec_widths) != n:
            raise ValueError(f"codec {self.name}: {n} down-samplings need {n + 1} encoder and {n} decoder widths")
        if self.audio_mels < 0 or self.audio_context < 0 or (self.audio_mels and self.audio_embed < 1):
            raise ValueError(f"codec {self.name}: audio_mels and audio_context must be >= 0 and audio_embed >= 1")
        if self.listen_features < 0 or (self.listen_features and (not self.audio_mels or self.listen_embed < 1)):
            raise ValueError(f"codec {self.name}: a listening stream (listen_features {self.listen_features}) needs an "
                             f"audio decoder (audio_mels > 0) and listen_embed >= 1")
        if self.mouth_dims < 0 or (self.mouth_dims and not self.audio_mels):
            raise ValueError(f"codec {self.name}: a per-frame mouth (mouth_dims {self.mouth_dims}) needs an audio "
                             f"decoder (audio_mels > 0)")

    @property
    def audio_rows(self) -> int:
        """Audio rows one decode reads: the 4 frames and audio_context either side."""
        return self.frames_per_latent + 2 * self.audio_context if self.audio_mels else 0

    @property
    def levels(self) -> int:
        return _levels(self.image_size, self.latent_grid)

    def to_dict(self) -> dict:
        """The fields a checkpoint records; an audio-free codec leaves the audio fields out, so that its
        checkpoints are written, and compared at load, exactly as before they existed."""
        d = asdict(self)
        unused = AUDIO_FIELDS if not self.audio_mels else (
            (LISTEN_FIELDS if not self.listen_features else ()) + (MOUTH_FIELDS if not self.mouth_dims else ()))
        for key in unused:
            d.pop(key)
        return d


LISTEN_FIELDS = ("listen_features", "listen_embed")
MOUTH_FIELDS = ("mouth_dims",)
AUDIO_FIELDS = ("audio_mels", "audio_context", "audio_embed", *LISTEN_FIELDS, *MOUTH_FIELDS)


def _levels(image_size: tuple[int, int], latent_grid: tuple[int, int]) -> int:
    (H, W), (h, w) = image_size, latent_grid
    if H % h or W % w or H // h != W // w or (H // h) & (H // h - 1):
        raise ValueError(f"image {image_size} must be the latent grid {latent_grid} times a power of two on both axes")
    return int(math.log2(H // h))


def codec_config(spec: ModelSpec, *, audio: bool = False, **changes) -> CodecConfig:
    """The codec shape for a model spec: width doubles as resolution halves, up to a cap. With `audio`, the decoder
    reads the spec's log-mel rows of its 4 frames and one frame either side (the renderer's mouth follows a frame
    and its two neighbours); `changes` override any field."""
    n = _levels(spec.image_size, spec.latent_grid)
    small = spec.image_size[0] <= 64
    base, cap, enc_cap = (16, 64, 64) if small else (32, 192, 128)
    dec = tuple(min(base * 2 ** (n - i), cap) for i in range(n))
    enc = tuple(min(max(base * 2 ** i // 2, 16), enc_cap) for i in range(n + 1))
    cfg = CodecConfig(
        name=f"{spec.name}-codec", image_size=tuple(spec.image_size), latent_channels=spec.latent_channels,
        latent_grid=tuple(spec.latent_grid), frames_per_latent=spec.frames_per_latent,
        enc_widths=enc, dec_widths=dec, latent_blocks=1 if small else 2,
    )
    if audio:
        cfg = replace(cfg, audio_mels=spec.n_mels, audio_context=min(1, spec.audio_context))
    return replace(cfg, **changes) if changes else cfg


def _groups(c: int) -> int:
    return math.gcd(c, 8)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(_groups(c), c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(_groups(c), c), nn.Conv2d(c, c, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)  # starts as identity
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        return x + self.conv2(F.silu(self.norm2(h)))


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        w = cfg.enc_widths
        self.stem = nn.Conv2d(3 * cfg.frames_per_latent, w[0], 3, padding=1)
        self.stages = nn.ModuleList(
            nn.Sequential(ResBlock(w[i]), nn.Conv2d(w[i], w[i + 1], 3, stride=2, padding=1)) for i in range(cfg.levels)
        )
        self.out = nn.Sequential(ResBlock(w[-1]), nn.GroupNorm(_groups(w[-1]), w[-1]), nn.SiLU(),
                                 nn.Conv2d(w[-1], cfg.latent_channels, 1))
        self.norm = nn.BatchNorm2d(cfg.latent_channels, affine=False, momentum=0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 12, H, W) in [-1, 1] -> (B, C, h, w)
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.norm(self.out(x))


def frame_windows(audio: torch.Tensor, span: int) -> torch.Tensor:
    """Audio rows (B, 4 + span - 1, mels) -> each decoded frame's window (B, 4, span * mels): frame j reads rows
    j .. j + span - 1, its own row and audio_context either side."""
    return audio.unfold(1, span, 1).flatten(2)


class AudioEmbed(nn.Module):
    """Each decoded frame's audio rows (its own and `audio_context` either side) -> an embedding; the 4 frames'
    embeddings condition the decoder: (B, 4 + 2 ctx, mels) -> (B, 4, embed)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.span = 2 * cfg.audio_context + 1
        e = cfg.audio_embed
        self.mlp = nn.Sequential(nn.Linear(self.span * cfg.audio_mels, e), nn.SiLU(), nn.Linear(e, e), nn.SiLU())

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        return self.mlp(frame_windows(audio, self.span))  # (B, 4, embed)


class FiLM(nn.Module):
    """x * (1 + scale) + shift per channel, from the audio embedding; zero-initialised: the identity at first."""

    def __init__(self, cond: int, channels: int):
        super().__init__()
        self.proj = nn.Linear(cond, 2 * channels)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) and cond (B, cond), or x (B, 1, C, H, W) and cond (B, F, cond): F modulated copies."""
        scale, shift = self.proj(cond)[..., None, None].chunk(2, dim=-3)
        return torch.addcmul(shift, x, 1 + scale)  # one pass over x


class FrameMouth(nn.Module):
    """Each frame's mouth (opening, roundness) read from its audio rows, and per-pixel bases, drawn from the
    decoder's last features, for its departure from the group's mean mouth: frame f gets
    sum_k relu(d_fk) * opening_k + relu(-d_fk) * closing_k added, d_fk = m_fk - mean over the group of m_k.
    The latent holds the group's mean mouth; this draws each frame's departure from it, so the mouth moves at
    24 Hz. Opening and closing draw different pixels (the interior shows or hides), hence a basis for each
    sign; each is linear in the departure, which holds while the lips move a pixel or two a frame. The mouth
    follows a frame's sound and its neighbours' (the renderer's rule), so it is learnt from the rendered states
    directly. The bases start at zero: a decoder that gains them decodes as before."""

    def __init__(self, cfg: CodecConfig, channels: int):
        super().__init__()
        self.span, self.dims = 2 * cfg.audio_context + 1, cfg.mouth_dims
        self.predict = nn.Sequential(nn.Linear(self.span * cfg.audio_mels, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                                     nn.Linear(64, cfg.mouth_dims))
        self.basis = nn.Sequential(nn.Conv2d(channels, 4 * 3 * 2 * cfg.mouth_dims, 3, padding=1), nn.PixelShuffle(2))
        nn.init.zeros_(self.basis[0].weight)
        nn.init.zeros_(self.basis[0].bias)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """(B, 4 + 2 ctx, mels) -> each frame's mouth (B, 4, dims)."""
        return self.predict(frame_windows(audio, self.span))

    def draw(self, features: torch.Tensor, mouth: torch.Tensor) -> torch.Tensor:
        """Features (B, C, H/2, W/2) and the frames' mouths (B, 4, dims) -> each frame's change (B, 4, 3, H, W)."""
        basis = self.basis(features).unflatten(1, (2 * self.dims, 3))  # (B, 2 dims, 3, H, W)
        departure = mouth - mouth.mean(1, keepdim=True)
        signed = torch.cat([departure.clamp(min=0), (-departure).clamp(min=0)], -1)  # (B, 4, 2 dims)
        return torch.einsum("bfk,bkchw->bfchw", signed.to(basis.dtype), basis)


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        w = cfg.dec_widths
        self.stem = nn.Conv2d(cfg.latent_channels, w[0], 3, padding=1)
        self.latent_blocks = nn.Sequential(*(ResBlock(w[0]) for _ in range(cfg.latent_blocks)))
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(w[i], w[i + 1], 3, padding=1), ResBlock(w[i + 1]))
            for i in range(cfg.levels - 1)
        )
        # The last doubling is a pixel shuffle: full-resolution convolutions would cost a third of the decode.
        k = 3 * cfg.frames_per_latent
        self.out = nn.Sequential(nn.GroupNorm(_groups(w[-1]), w[-1]), nn.SiLU(), nn.Conv2d(w[-1], 4 * k, 3, padding=1),
                                 nn.PixelShuffle(2))
        self.audio_rows = cfg.audio_rows
        self.frames, self.listen_features = cfg.frames_per_latent, cfg.listen_features
        if cfg.audio_mels:
            # Shared FiLM (all 4 frames' embeddings) after the latent blocks and each stage but the last; then one
            # modulated copy of the output features per frame, from that frame's own embedding, each drawn by its
            # frame's slice of the output convolution (a grouped convolution with the same weights).
            frame_cond = cfg.audio_embed + (cfg.listen_embed if cfg.listen_features else 0)
            self.audio = AudioEmbed(cfg)
            if cfg.listen_features:
                e = cfg.listen_embed
                self.listen = nn.Sequential(nn.Linear(cfg.listen_features, e), nn.SiLU(), nn.Linear(e, e), nn.SiLU())
            self.film = nn.ModuleList(FiLM(cfg.frames_per_latent * frame_cond, c) for c in (w[0], *w[1:-1]))
            self.frame_film = FiLM(frame_cond, w[-1])
        self.mouth_dims = cfg.mouth_dims
        if cfg.mouth_dims:
            self.mouth = FrameMouth(cfg, w[-1])

    def forward(self, z: torch.Tensor, audio: torch.Tensor | None = None, listen: torch.Tensor | None = None,
                mouth: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C, h, w), audio (B, 4 + 2 ctx, mels) with audio_mels, listen (B, 4, listen_features) with
        listen_features (None: silence) -> (B, 12, H, W), about [-1, 1]. With mouth_dims the frames' mouths
        (B, 4, mouth_dims) are drawn; None: the ones the audio predicts (training passes the true ones)."""
        x = self.latent_blocks(self.stem(z))
        if not self.audio_rows:
            for stage in self.stages:
                x = stage(x)
            return self.out(x)
        per_frame = self.audio(audio)  # (B, 4, embed)
        if self.listen_features:
            heard = listen if listen is not None else per_frame.new_zeros(z.shape[0], self.frames, self.listen_features)
            per_frame = torch.cat([per_frame, self.listen(heard.to(per_frame.dtype))], -1)
        cond = per_frame.flatten(1)
        x = self.film[0](x, cond)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i < len(self.stages) - 1:  # the last stage's output is normalised and modulated at the output
                x = self.film[i + 1](x, cond)
        normed = self.out[0](x)
        x = self.frame_film(normed[:, None], per_frame)  # (B, 4, C, H/2, W/2)
        conv = self.out[2]
        x = F.conv2d(self.out[1](x.flatten(1, 2)), conv.weight, conv.bias, padding=1, groups=self.frames)
        x = self.out[3](x)
        if not self.mouth_dims:
            return x
        mouth = self.mouth(audio) if mouth is None else mouth
        return x + self.mouth.draw(self.out[1](normed), mouth).flatten(1, 2)


class TrainedCodec(nn.Module):
    """The engine's codec seam (decode / encode_reference) plus batched training-time methods."""

    def __init__(self, cfg: CodecConfig, spec: ModelSpec | None = None):
        super().__init__()
        self.cfg = cfg
        self.spec = spec
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    # Batched, differentiable ---------------------------------------------------------
    def encode_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """Float frames (B, 4, 3, H, W) in [0, 1] -> latents (B, C, h, w)."""
        k, (H, W) = self.cfg.frames_per_latent, self.cfg.image_size
        if frames.ndim != 5 or tuple(frames.shape[1:]) != (k, 3, H, W):
            raise ValueError(f"frames must be (B, {k}, 3, {H}, {W}), got {tuple(frames.shape)}")
        return self.encoder(frames.flatten(1, 2) * 2.0 - 1.0)

    @property
    def audio_mels(self) -> int:
        return self.cfg.audio_mels

    @property
    def audio_context(self) -> int:
        return self.cfg.audio_context

    @property
    def listen_features(self) -> int:
        return self.cfg.listen_features

    def decode_frames(self, latents: torch.Tensor, audio: torch.Tensor | None = None,
                      listen: torch.Tensor | None = None, mouth: torch.Tensor | None = None) -> torch.Tensor:
        """Latents (B, C, h, w) -> float frames (B, 4, 3, H, W), about [0, 1] (not clamped). An audio decoder
        needs `audio` (B, 4 + 2 audio_context, audio_mels): each frame's log-mel rows; others ignore it. A
        listening one reads `listen` (B, 4, listen_features), the user's voice (None: silence). One with
        mouth_dims draws `mouth` (B, 4, mouth_dims), each frame's mouth, if given (training), else the audio's."""
        c, (h, w) = self.cfg.latent_channels, self.cfg.latent_grid
        if latents.ndim != 4 or tuple(latents.shape[1:]) != (c, h, w):
            raise ValueError(f"latents must be (B, {c}, {h}, {w}), got {tuple(latents.shape)}")
        if self.cfg.audio_mels:
            rows = (latents.shape[0], self.cfg.audio_rows, self.cfg.audio_mels)
            if audio is None:
                raise ValueError(f"this codec is audio-conditioned: decoding needs each frame's audio features {rows[1:]}")
            if tuple(audio.shape) != rows:
                raise ValueError(f"audio must be {rows}, got {tuple(audio.shape)}")
            heard = (latents.shape[0], self.cfg.frames_per_latent, self.cfg.listen_features)
            if listen is not None and self.cfg.listen_features and tuple(listen.shape) != heard:
                raise ValueError(f"listening rows must be {heard}, got {tuple(listen.shape)}")
            shaped = (latents.shape[0], self.cfg.frames_per_latent, self.cfg.mouth_dims)
            if mouth is not None and self.cfg.mouth_dims and tuple(mouth.shape) != shaped:
                raise ValueError(f"mouths must be {shaped}, got {tuple(mouth.shape)}")
            out = self.decoder(latents, audio.to(latents.dtype), listen if self.cfg.listen_features else None,
                               mouth if self.cfg.mouth_dims else None)
        else:
            out = self.decoder(latents)
        return (out.unflatten(1, (self.cfg.frames_per_latent, 3)) + 1.0) / 2.0

    # The engine's seam ---------------------------------------------------------------
    def _param(self) -> torch.Tensor:
        return next(self.parameters())

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, audio: torch.Tensor | None = None,
               listen: torch.Tensor | None = None) -> torch.Tensor:
        """One latent frame (C, h, w) -> 4 RGB frames (4, H, W, 3) uint8. An audio decoder needs `audio`
        (4 + 2 audio_context, audio_mels): the log-mel rows of frames first - audio_context on (`decode_step`
        cuts them from a step's window); an audio-free one ignores it. A listening decoder reads `listen`
        (4, listen_features), the user's voice over the 4 frames (None: silence)."""
        c, (h, w) = self.cfg.latent_channels, self.cfg.latent_grid
        if not isinstance(latent, torch.Tensor) or tuple(latent.shape) != (c, h, w):
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ValueError(f"latent must have shape {(c, h, w)}, got {shape}")
        p = self._param()
        rows = heard = None
        if self.cfg.audio_mels:
            rows = self._check_audio(audio)[None].to(p.device, p.dtype, non_blocking=True)
        if self.cfg.listen_features and listen is not None:
            expected = (self.cfg.frames_per_latent, self.cfg.listen_features)
            if not isinstance(listen, torch.Tensor) or tuple(listen.shape) != expected:
                shape = tuple(listen.shape) if isinstance(listen, torch.Tensor) else type(listen).__name__
                raise ValueError(f"listening rows must have shape {expected}, got {shape}")
            heard = listen[None].to(p.device, p.dtype, non_blocking=True)
        frames = self.decode_frames(latent[None].to(p.device, p.dtype), rows, heard)[0]  # (4, 3, H, W)
        return (frames.permute(0, 2, 3, 1).float().clamp(0, 1) * 255.0).round().to(torch.uint8)

    def _check_audio(self, audio: torch.Tensor | None) -> torch.Tensor:
        """One decode's audio rows, checked. Finiteness is checked on the CPU only (as the engine hands them):
        a check of rows on a GPU would wait for it."""
        expected = (self.cfg.audio_rows, self.cfg.audio_mels)
        if audio is None:
            raise ValueError(f"this codec is audio-conditioned: decode(latent, audio=...) needs the audio features "
                             f"{expected} of its frames (engine.codec.decode_step cuts them from a step's window)")
        if not isinstance(audio, torch.Tensor) or tuple(audio.shape) != expected:
            shape = tuple(audio.shape) if isinstance(audio, torch.Tensor) else type(audio).__name__
            raise ValueError(f"audio must have shape {expected} (frames first - {self.cfg.audio_context} on), got {shape}")
        if audio.device.type == "cpu" and not torch.isfinite(audio).all():
            raise ValueError("audio features contain NaN or infinite values")
        return audio

    @torch.no_grad()
    def encode_reference(self, image: torch.Tensor) -> torch.Tensor:
        """A picture (H, W, 3), uint8 or float in [0, 1] -> latent (C, h, w): the picture held for 4 frames."""
        x = check_image(image, self.spec or self.cfg)  # (3, H, W)
        if tuple(x.shape[1:]) != tuple(self.cfg.image_size):
            raise ValueError(f"reference image must be {tuple(self.cfg.image_size)} pixels, got {tuple(x.shape[1:])}")
        p = self._param()
        held = x[None, None].expand(1, self.cfg.frames_per_latent, -1, -1, -1).to(p.device, p.dtype)
        return self.encode_frames(held)[0].float()


def build_codec(spec: ModelSpec, *, seed: int = 0, cfg: CodecConfig | None = None) -> TrainedCodec:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        codec = TrainedCodec(cfg or codec_config(spec), spec)
    return codec.eval()


def codec_path(spec: ModelSpec, assets: str | Path) -> Path:
    return Path(assets) / f"{spec.name}-codec.pt"


def save_codec(codec: TrainedCodec, path: str | Path, *, half: bool = True) -> str:
    """Weights (bf16 unless half=False; BatchNorm statistics stay float32) + config, with a .sha256 beside them."""
    state_module = codec
    if half:
        state_module = copy.deepcopy(codec).cpu()
        for mod in state_module.modules():
            if not isinstance(mod, nn.BatchNorm2d):
                for p in mod.parameters(recurse=False):
                    p.data = p.data.to(torch.bfloat16)
    return save_checkpoint(state_module, codec.cfg, path)


def saved_audio_fields(path: str | Path) -> dict:
    """The audio fields a codec checkpoint records (none for an audio-free one, or a file that cannot be read:
    load_checkpoint then says what is wrong with it). Read through a memory map, without the weights."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    saved = blob.get("spec") if isinstance(blob, dict) else None
    if not isinstance(saved, dict):
        return {}
    return {k: saved[k] for k in AUDIO_FIELDS if isinstance(saved.get(k), int)}


def load_codec(spec: ModelSpec, path: str | Path, *, expected_sha256: str | None = None) -> TrainedCodec:
    """A trained codec for `spec` from a checkpoint, sha256-verified (ValueError on any mismatch). Its decoder
    reads audio when the checkpoint says so; every other field must be the spec's codec shape."""
    codec = build_codec(spec, cfg=codec_config(spec, **saved_audio_fields(path)))
    load_checkpoint(codec, codec.cfg, path, expected_sha256=expected_sha256)
    return codec.eval()

