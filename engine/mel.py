"""The engine's audio front end: 16 kHz mono PCM -> one log-mel vector per video frame.

Video frame i (at `fps`) is described by a Hann-windowed spectrum centred on the
middle of its time span, so features line up with the frame clock exactly, whatever
the ratio of sample rate to frame rate (16000 / 24 is not an integer).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.audio import SAMPLE_RATE, frame_sample

N_FFT = 1024
_FLOOR = 1e-6


def _check_pcm(pcm: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
    if sample_rate != SAMPLE_RATE:
        raise ValueError(f"audio must be {SAMPLE_RATE} Hz for the engine's front end, got {sample_rate} Hz (resample first)")
    x = torch.as_tensor(np.asarray(pcm) if not isinstance(pcm, torch.Tensor) else pcm)
    if x.ndim != 1:
        raise ValueError(f"audio must be mono, shape (samples,), got shape {tuple(x.shape)}")
    if x.dtype == torch.int16:
        x = x.float() / 32768.0
    elif not x.is_floating_point():
        raise ValueError(f"audio samples must be float or int16, got {x.dtype}")
    x = x.float()
    if not torch.isfinite(x).all():
        raise ValueError("audio contains NaN or infinite samples")
    return x


def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE, fmin: float = 20.0, fmax: float = 7600.0) -> torch.Tensor:
    """Triangular HTK-mel filters (n_mels, n_fft // 2 + 1)."""
    def to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def to_hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    edges = to_hz(np.linspace(to_mel(fmin), to_mel(fmax), n_mels + 2))
    bins = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None] - lower) / (centre - lower)
    falling = (upper - bins[None]) / (upper - centre)
    return torch.from_numpy(np.clip(np.minimum(rising, falling), 0.0, None)).float()


_FILTERBANKS: dict[int, torch.Tensor] = {}


def log_mel_frames(pcm: np.ndarray | torch.Tensor, n_mels: int, first_frame: int = 0, n_frames: int | None = None,
                   fps: int = 24, sample_rate: int = SAMPLE_RATE, pcm_start_frame: int = 0) -> torch.Tensor:
    """Features (n_frames, n_mels) of video frames [first_frame, first_frame + n_frames).

    `pcm` starts at the first sample of video frame `pcm_start_frame`; audio outside it
    counts as silence. n_frames defaults to every frame the audio touches.
    """
    x = _check_pcm(pcm, sample_rate)
    if n_frames is None:
        n_frames = math.ceil(x.numel() * fps / SAMPLE_RATE) - (first_frame - pcm_start_frame)
    n_frames = max(int(n_frames), 0)
    if n_mels not in _FILTERBANKS:
        _FILTERBANKS[n_mels] = mel_filterbank(n_mels)
    frames = torch.arange(first_frame, first_frame + n_frames, dtype=torch.float64)
    centres = torch.round((frames + 0.5) * SAMPLE_RATE / fps).long() - frame_sample(pcm_start_frame, fps)
    idx = centres[:, None] + torch.arange(N_FFT) - N_FFT // 2  # (n_frames, N_FFT)
    inside = (idx >= 0) & (idx < x.numel())
    src = x if x.numel() else torch.zeros(1)
    windows = torch.where(inside, src[idx.clamp(0, src.numel() - 1)], 0.0)
    spectrum = torch.fft.rfft(windows * torch.hann_window(N_FFT, periodic=True), dim=-1).abs().pow(2)
    mel = spectrum @ _FILTERBANKS[n_mels].T
    return (torch.log10(mel + _FLOOR) + 4.0) / 4.0


def silence_features(n_mels: int) -> torch.Tensor:
    """The feature vector of a silent frame (n_mels,)."""
    return torch.full((n_mels,), (math.log10(_FLOOR) + 4.0) / 4.0)
