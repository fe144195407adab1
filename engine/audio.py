"""Audio samples: the one sample rate, the frame clock, conversion, resampling and audio files.

Everything downstream (the engine's front end, the voice agent, the app) works on 16 kHz
mono float32; this module turns other rates, channel layouts, integer formats and files
into that, or rejects them with a ValueError that says why. It needs no torch, so the
voice agent can use it without loading the engine's model code.

Resampling uses libsoxr (the `soxr` package, "HQ" preset: a linear-phase polyphase
filter with ~-140 dB stop-band), fast enough to run per chunk.
"""

from __future__ import annotations

import io
import math
import os
import struct
import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np

SAMPLE_RATE = 16_000
# Longest input the one-shot paths accept; a live loop bounds each turn instead.
MAX_INPUT_SECONDS = 600.0

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_IEEE_FLOAT = 3
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


# The frame clock ------------------------------------------------------------------
def frame_sample(frame: int, fps: int = 24) -> int:
    """First sample of video frame `frame` (frames tile the samples without gaps)."""
    return round(frame * SAMPLE_RATE / fps)


def frame_of_sample(sample: int, fps: int = 24) -> int:
    """The video frame whose span holds `sample` (inverse of frame_sample)."""
    return math.floor((sample + 0.5) * fps / SAMPLE_RATE)


# Resampling -----------------------------------------------------------------------
def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample a whole mono signal to float32 (libsoxr HQ); output length is round(n * to / from)."""
    if from_rate == to_rate:
        return samples.astype(np.float32, copy=False)
    import soxr  # here and in StreamResampler: only a change of rate needs it, so 16 kHz hosts run without it

    return soxr.resample(samples.astype(np.float32, copy=False), from_rate, to_rate, quality="HQ")


class StreamResampler:
    """Resample a mono stream chunk by chunk without seams at chunk edges.

    Keeps filter state between calls, so output of many small chunks equals the
    output of one big chunk (minus a few ms of filter delay at the start).
    """

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self.from_rate = from_rate
        self.to_rate = to_rate
        self._stream = None
        if from_rate != to_rate:
            import soxr

            self._stream = soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality="HQ")

    def process(self, samples: np.ndarray, last: bool = False) -> np.ndarray:
        samples = samples.astype(np.float32, copy=False)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)


# Conversion -----------------------------------------------------------------------
def to_mono_16k(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """The engine's conversion: float or int16, (samples,) or (samples, channels), any rate -> 16 kHz mono float32.

    Strict about formats (other integer types are refused) and lenient about length (empty is fine):
    speech pushed to the engine comes in chunks of any size, some empty.
    """
    x = np.asarray(pcm)
    if x.dtype == np.int16:  # scaled before the channels are mixed, which would leave it float
        x = x.astype(np.float32) / 32768.0
    elif not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"audio samples must be float or int16, got {x.dtype}")
    if x.ndim == 2:
        x = x.mean(axis=1) if x.shape[1] <= 8 else x.mean(axis=0)
    if x.ndim != 1:
        raise ValueError(f"audio must be (samples,) or (samples, channels), got shape {x.shape}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("audio contains NaN or infinite samples")
    if sample_rate <= 0:
        raise ValueError(f"sample rate must be positive, got {sample_rate}")
    return resample(x, sample_rate, SAMPLE_RATE)


def _to_float(samples: np.ndarray) -> np.ndarray:
    """Integer PCM or float of any width -> float32 in nominal [-1, 1]."""
    kind = samples.dtype.kind
    if kind == "f":
        return samples.astype(np.float32, copy=False)
    if kind == "i":
        scale = float(2 ** (8 * samples.dtype.itemsize - 1))
        return (samples.astype(np.float64) / scale).astype(np.float32)
    if kind == "u":
        half = float(2 ** (8 * samples.dtype.itemsize - 1))
        return ((samples.astype(np.float64) - half) / half).astype(np.float32)
    if kind == "b":
        raise ValueError("audio must be numeric samples, got booleans")
    raise ValueError(f"audio must be numeric samples, got dtype {samples.dtype}")


def _is_planar(samples: np.ndarray) -> bool:
    """(channels, frames) layout: channel counts are small, so a short first axis
    with a longer second one is planar audio."""
    return samples.ndim == 2 and samples.shape[0] <= 8 and samples.shape[1] > samples.shape[0]


def _to_mono(samples: np.ndarray) -> np.ndarray:
    """Average the channels of (frames, channels) or (channels, frames) audio."""
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise ValueError(f"audio must be 1-D mono or 2-D (frames, channels), got shape {samples.shape}")
    return samples.mean(axis=0 if _is_planar(samples) else 1, dtype=np.float32)


def validate_samples(samples: np.ndarray, what: str = "audio") -> None:
    """Reject audio the pipeline cannot make sense of: empty or non-finite."""
    if samples.size == 0:
        raise ValueError(f"{what} is empty (no samples)")
    if not np.all(np.isfinite(samples)):
        bad = int(np.count_nonzero(~np.isfinite(samples)))
        raise ValueError(f"{what} contains {bad} NaN or infinite samples")


def to_mono_float32(
    pcm: np.ndarray,
    sample_rate: int,
    target_rate: int = SAMPLE_RATE,
    max_seconds: float | None = None,
) -> np.ndarray:
    """The voice agent's conversion: any numeric PCM array -> mono float32 at target_rate.

    Stereo or planar multi-channel audio is averaged to mono, integer formats are
    scaled, samples beyond full scale are clipped (clipped input stays usable).
    Raises ValueError for empty, NaN/inf, non-numeric or too long input.
    """
    if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive integer, got {sample_rate!r}")
    samples = np.asarray(pcm)
    if samples.dtype == object:
        raise ValueError("audio must be a numeric array")
    # Length first, so an hours-long array is refused before any work is done on it.
    frames = samples.shape[1] if _is_planar(samples) else (samples.shape[0] if samples.ndim else 0)
    seconds = frames / float(sample_rate)
    if max_seconds is not None and seconds > max_seconds:
        raise ValueError(f"audio is {seconds:.1f} s long; the limit is {max_seconds:.0f} s")
    mono = _to_mono(_to_float(samples))
    validate_samples(mono)
    mono = np.clip(mono, -1.0, 1.0)
    if sample_rate != target_rate:
        mono = resample(mono, int(sample_rate), target_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


# WAV files ------------------------------------------------------------------------
_FMT_READ_LIMIT = 64  # a fmt chunk is 16 to 40 bytes; more is ignored


def _parse_wav_header(f: BinaryIO, name: str, file_bytes: int) -> tuple[int, int, int, int, int, int]:
    """Return (format_tag, channels, sample_rate, bits, data_offset, data_bytes) of a RIFF/WAVE stream.

    data_bytes is what the data chunk declares, cut to the bytes the file holds: a WAV written to a pipe
    declares 0xFFFFFFFF, a truncated one more than it has."""
    riff = f.read(12)
    if len(riff) < 12 or riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
        raise ValueError(f"{name} is not a RIFF/WAVE file")
    fmt: tuple[int, int, int, int] | None = None
    while True:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{name} has no data chunk")
        chunk_id, size = head[:4], struct.unpack("<I", head[4:])[0]
        body_start = f.tell()
        if chunk_id == b"fmt ":
            body = f.read(min(size, _FMT_READ_LIMIT))
            if size < 16 or len(body) < 16:
                raise ValueError(f"{name} has a fmt chunk of {min(size, len(body))} bytes; it needs at least 16")
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == _WAVE_FORMAT_EXTENSIBLE:
                if len(body) < 26:
                    raise ValueError(f"{name} has an extensible-format fmt chunk of {len(body)} bytes, too short for its sub-format")
                tag = struct.unpack("<H", body[24:26])[0]  # first two bytes of the sub-format GUID
            fmt = (tag, channels, rate, bits)
            f.seek(body_start + size + (size & 1))
        elif chunk_id == b"data":
            if fmt is None:
                raise ValueError(f"{name} has a data chunk before its fmt chunk")
            return (*fmt, body_start, min(size, file_bytes - body_start))
        else:
            f.seek(size + (size & 1), 1)


# (format tag, bits per sample) -> numpy dtype of one sample; 24-bit integers are unpacked by hand.
_SAMPLE_TYPES = {
    (_WAVE_FORMAT_PCM, 8): np.dtype(np.uint8),
    (_WAVE_FORMAT_PCM, 16): np.dtype("<i2"),
    (_WAVE_FORMAT_PCM, 24): None,
    (_WAVE_FORMAT_PCM, 32): np.dtype("<i4"),
    (_WAVE_FORMAT_IEEE_FLOAT, 32): np.dtype("<f4"),
    (_WAVE_FORMAT_IEEE_FLOAT, 64): np.dtype("<f8"),
}


def _decode_samples(raw: bytes, tag: int, bits: int) -> np.ndarray:
    """Little-endian samples of a supported encoding (raw holds whole samples) -> float32."""
    dtype = _SAMPLE_TYPES[(tag, bits)]
    if dtype is not None:
        return _to_float(np.frombuffer(raw, dtype=dtype))
    b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend
    return (ints / float(2**23)).astype(np.float32)


def _read_wav_stream(f: BinaryIO, name: str, file_bytes: int, max_seconds: float | None) -> tuple[np.ndarray, int]:
    tag, channels, rate, bits, offset, data_bytes = _parse_wav_header(f, name, file_bytes)
    if channels < 1 or rate < 1 or bits < 8:
        raise ValueError(f"{name} has an invalid format header ({channels} channels, {rate} Hz, {bits} bits)")
    if (tag, bits) not in _SAMPLE_TYPES:
        raise ValueError(f"{name}: unsupported WAV encoding (format tag {tag}, {bits} bits)")
    frame_bytes = channels * (bits // 8)
    frames = data_bytes // frame_bytes
    if max_seconds is not None and frames / rate > max_seconds:
        raise ValueError(f"{name} is {frames / rate:.1f} s long; the limit is {max_seconds:.0f} s")
    f.seek(offset)
    raw = f.read(frames * frame_bytes)
    raw = raw[: len(raw) - len(raw) % frame_bytes]  # the file may have shrunk since its size was taken
    samples = _decode_samples(raw, tag, bits)
    if channels > 1:
        samples = samples.reshape(-1, channels)
    return samples, rate


def read_wav(source: str | Path | bytes, max_seconds: float | None = MAX_INPUT_SECONDS) -> tuple[np.ndarray, int]:
    """Read a WAV file (a path, or the file's bytes) as (samples, sample_rate) without converting channels or rate.

    Integer PCM (8/16/24/32-bit) and IEEE float (32/64-bit) are supported, plain or
    WAVE_FORMAT_EXTENSIBLE; the length is checked from the header and the file size
    before any samples are read, so an hours-long file is rejected at once. A file cut
    short, or streamed with an unknown length, is read to its last whole frame. Samples
    come back as float32, shaped (frames,) for mono or (frames, channels).
    """
    if isinstance(source, (bytes, bytearray)):
        return _read_wav_stream(io.BytesIO(source), "WAV data", len(source), max_seconds)
    path = Path(source)
    with open(path, "rb") as f:
        return _read_wav_stream(f, str(path), os.fstat(f.fileno()).st_size, max_seconds)


def load_wav_16k(source: str | Path | bytes, max_seconds: float | None = MAX_INPUT_SECONDS) -> np.ndarray:
    """Read any supported WAV (a path, or the file's bytes) and return validated 16 kHz mono float32."""
    samples, rate = read_wav(source, max_seconds=max_seconds)
    try:
        return to_mono_float32(samples, rate, max_seconds=max_seconds)
    except ValueError as err:
        name = "WAV data" if isinstance(source, (bytes, bytearray)) else str(source)
        raise ValueError(f"{name}: {err}") from err


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """Write mono float audio as 16-bit PCM WAV."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm16 = (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm16.tobytes())
    return path


# Any audio file ---------------------------------------------------------------------
def read_audio(path: str | Path, max_seconds: float | None = None) -> np.ndarray:
    """Any audio file FFmpeg reads (through PyAV) -> 16 kHz mono float32; clear errors for missing or broken files.

    FFmpeg decodes and mixes down to mono at the file's own rate; `resample` brings it to 16 kHz, so every
    path into the engine and the voice agent shares one resampler."""
    import av  # FFmpeg, for compressed files only: WAV readers and the served path run without it

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"audio file not found: {path}")
    to_mono = av.AudioResampler(format="flt", layout="mono")  # no rate: the file's own
    chunks: list[np.ndarray] = []
    total, rate = 0, 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError(f"{path} has no audio stream")
            for frame in container.decode(audio=0):
                rate = rate or frame.sample_rate
                if frame.sample_rate != rate:
                    raise ValueError(f"{path} changes its sample rate from {rate} to {frame.sample_rate} Hz mid-stream")
                for out in to_mono.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if max_seconds is not None and total > max_seconds * rate:
                    raise ValueError(f"{path} is longer than {max_seconds:g} s")
            for out in to_mono.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as e:
        raise ValueError(f"cannot decode audio from {path}: {e}") from e
    pcm = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if not np.isfinite(pcm).all():
        raise ValueError(f"{path} decodes to NaN or infinite samples")
    return resample(pcm, rate, SAMPLE_RATE) if pcm.size else pcm
