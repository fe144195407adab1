import os
import struct
import time
import wave

import numpy as np
import pytest

from engine.audio import StreamResampler, load_wav_16k, read_wav, resample, to_mono_float32, write_wav


def tone(freq: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[np.argmax(spectrum)])


def test_stereo_int16_44k_becomes_mono_float32_16k_with_pitch_kept():
    left = tone(440, 1.0, 44100)
    stereo = (np.stack([left, left], axis=1) * 32767).astype(np.int16)
    out = to_mono_float32(stereo, 44100)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(out.size - 16000) <= 16
    assert abs(peak_frequency(out, 16000) - 440) < 3
    assert abs(float(np.max(np.abs(out))) - 0.5) < 0.02


def test_planar_and_interleaved_stereo_agree():
    left, right = tone(300, 0.5, 16000), tone(500, 0.5, 16000)
    interleaved = to_mono_float32(np.stack([left, right], axis=1), 16000)
    planar = to_mono_float32(np.stack([left, right], axis=0), 16000)
    np.testing.assert_allclose(interleaved, planar, atol=1e-6)
    np.testing.assert_allclose(interleaved, (left + right) / 2, atol=1e-6)


@pytest.mark.parametrize(
    "samples, expected",
    [
        (np.array([0, 16384, -32768], dtype=np.int16), [0.0, 0.5, -1.0]),
        (np.array([128, 192, 0], dtype=np.uint8), [0.0, 0.5, -1.0]),
        (np.array([0, 2**30, -(2**31)], dtype=np.int32), [0.0, 0.5, -1.0]),
    ],
)
def test_integer_formats_are_scaled_to_unit_range(samples, expected):
    np.testing.assert_allclose(to_mono_float32(samples, 16000), expected, atol=1e-4)


def test_clipped_input_is_limited_to_full_scale():
    loud = tone(200, 0.5, 16000, amplitude=3.0)
    out = to_mono_float32(loud, 16000)
    assert float(np.max(np.abs(out))) <= 1.0
    assert np.count_nonzero(np.abs(out) == 1.0) > out.size // 4


@pytest.mark.parametrize(
    "samples, rate, message",
    [
        (np.zeros(0, np.float32), 16000, "empty"),
        (np.array([0.1, np.nan, 0.2], np.float32), 16000, "NaN"),
        (np.array([0.1, np.inf], np.float64), 16000, "infinite"),
        (np.zeros((2, 3, 4), np.float32), 16000, "shape"),
        (np.array(["a", "b"]), 16000, "numeric"),
        (np.zeros(10, np.float32), 0, "sample_rate"),
    ],
)
def test_bad_audio_is_rejected_with_a_reason(samples, rate, message):
    with pytest.raises(ValueError, match=message):
        to_mono_float32(samples, rate)


def test_hours_long_array_is_refused_before_any_work():
    two_hours = np.broadcast_to(np.int16(0), (2 * 3600 * 48000, 2))  # no memory behind it
    started = time.perf_counter()
    with pytest.raises(ValueError, match="7200.0 s long; the limit is 600 s"):
        to_mono_float32(two_hours, 48000, max_seconds=600)
    assert time.perf_counter() - started < 0.5


def test_stream_resampler_matches_one_shot_resampling():
    signal = tone(700, 1.0, 22050)
    whole = resample(signal, 22050, 48000)
    stream = StreamResampler(22050, 48000)
    pieces = [stream.process(signal[i : i + 441]) for i in range(0, signal.size, 441)]
    pieces.append(stream.process(np.zeros(0, np.float32), last=True))
    chunked = np.concatenate(pieces)
    assert abs(chunked.size - whole.size) <= 2
    n = min(chunked.size, whole.size)
    np.testing.assert_allclose(chunked[1000 : n - 1000], whole[1000 : n - 1000], atol=2e-3)


def test_wav_round_trip_pcm16(tmp_path):
    signal = tone(440, 0.5, 22050)
    path = write_wav(tmp_path / "a.wav", signal, 22050)
    samples, rate = read_wav(path)
    assert rate == 22050
    np.testing.assert_allclose(samples, signal, atol=1e-4)
    assert load_wav_16k(path).size == pytest.approx(8000, abs=8)


def _write_raw_wav(path, data: bytes, tag: int, channels: int, rate: int, bits: int, declared_bytes: int | None = None):
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    size = len(data) if declared_bytes is None else declared_bytes
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + size) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt)
        f.write(b"data" + struct.pack("<I", size) + data)


def test_float32_stereo_wav_is_read(tmp_path):
    left, right = tone(440, 0.25, 48000), tone(880, 0.25, 48000)
    frames = np.stack([left, right], axis=1).astype("<f4")
    _write_raw_wav(tmp_path / "f.wav", frames.tobytes(), tag=3, channels=2, rate=48000, bits=32)
    samples, rate = read_wav(tmp_path / "f.wav")
    assert rate == 48000 and samples.shape == frames.shape
    np.testing.assert_allclose(samples, frames)


def test_24_bit_wav_is_read(tmp_path):
    values = np.array([0, 2**22, -(2**23)], dtype=np.int32)
    raw = b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in values)
    _write_raw_wav(tmp_path / "p24.wav", raw, tag=1, channels=1, rate=16000, bits=24)
    samples, _ = read_wav(tmp_path / "p24.wav")
    np.testing.assert_allclose(samples, [0.0, 0.5, -1.0], atol=1e-6)


def test_wav_of_hours_is_refused_from_its_header(tmp_path):
    path = tmp_path / "long.wav"
    declared = 3 * 3600 * 16000 * 2
    _write_raw_wav(path, b"\0" * 64, tag=1, channels=1, rate=16000, bits=16, declared_bytes=declared)
    os.truncate(path, 44 + declared)  # the hours of samples are there (a sparse file: no disk behind them)
    started = time.perf_counter()
    with pytest.raises(ValueError, match="10800.0 s long"):
        read_wav(path)
    assert time.perf_counter() - started < 0.5


def _extensible_fmt(channels: int, rate: int, bits: int, sub_format: int) -> bytes:
    block = channels * bits // 8
    guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"  # KSDATAFORMAT_SUBTYPE_* after its tag
    return struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * block, block, bits, 22, bits, 0x3) + struct.pack("<H", sub_format) + guid_tail


def _write_wav_chunks(path, fmt: bytes, data: bytes, declared_bytes: int | None = None) -> None:
    size = len(data) if declared_bytes is None else declared_bytes
    path.write_bytes(b"RIFF" + struct.pack("<I", min(0xFFFFFFFF, 20 + len(fmt) + size)) + b"WAVE"
                     + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size) + data)


@pytest.mark.parametrize("bits, dtype", [(16, "<i2"), (32, "<i4")])
def test_extensible_integer_wav_is_read(tmp_path, bits, dtype):
    """WAVE_FORMAT_EXTENSIBLE (what many tools write for stereo or over 16 bits); the wave module refuses it."""
    left, right = tone(440, 0.25, 48000), tone(880, 0.25, 48000)
    scale = 2 ** (bits - 1) - 1
    frames = np.round(np.stack([left, right], axis=1) * scale).astype(dtype)
    _write_wav_chunks(tmp_path / "x.wav", _extensible_fmt(2, 48000, bits, sub_format=1), frames.tobytes())
    samples, rate = read_wav(tmp_path / "x.wav")
    assert rate == 48000 and samples.shape == frames.shape
    np.testing.assert_allclose(samples, np.stack([left, right], axis=1), atol=1e-4)


def test_wav_written_to_a_pipe_is_read_to_its_end(tmp_path):
    """A writer that cannot seek back leaves the data size at 0xFFFFFFFF."""
    signal = tone(440, 0.5, 22050)
    pcm = (signal * 32767).astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, 22050, 44100, 2, 16)
    _write_wav_chunks(tmp_path / "piped.wav", fmt, pcm, declared_bytes=0xFFFFFFFF)
    samples, rate = read_wav(tmp_path / "piped.wav")
    assert rate == 22050
    np.testing.assert_allclose(samples, signal, atol=1e-4)


@pytest.mark.parametrize("tag, bits, channels", [(1, 16, 2), (1, 24, 1), (1, 24, 2), (3, 32, 1), (3, 64, 2)])
def test_truncated_wav_is_read_to_its_last_whole_frame(tmp_path, tag, bits, channels):
    frame = channels * bits // 8
    _write_raw_wav(tmp_path / "cut.wav", b"\0" * (10 * frame + frame - 1), tag=tag, channels=channels, rate=16000, bits=bits,
                   declared_bytes=100 * frame)
    samples, _ = read_wav(tmp_path / "cut.wav")
    assert samples.shape == ((10,) if channels == 1 else (10, channels))


def test_short_fmt_chunk_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "short-fmt.wav"
    _write_wav_chunks(path, struct.pack("<HHIIH", 1, 1, 16000, 32000, 2), b"\0" * 64)  # 14 bytes: no bits field
    with pytest.raises(ValueError, match=f"{path} has a fmt chunk of 14 bytes; it needs at least 16"):
        read_wav(path)
    _write_wav_chunks(path, struct.pack("<HHIIHHH", 0xFFFE, 1, 16000, 32000, 2, 16, 0), b"\0" * 64)
    with pytest.raises(ValueError, match=f"{path} has an extensible-format fmt chunk of 18 bytes"):
        read_wav(path)


def test_nan_float_wav_and_non_wav_files_are_refused(tmp_path):
    _write_raw_wav(tmp_path / "nan.wav", np.full(160, np.nan, "<f4").tobytes(), tag=3, channels=1, rate=16000, bits=32)
    with pytest.raises(ValueError, match=r"nan\.wav: audio contains 160 NaN"):
        load_wav_16k(tmp_path / "nan.wav")
    (tmp_path / "notes.wav").write_text("not audio")
    with pytest.raises(ValueError, match="RIFF"):
        read_wav(tmp_path / "notes.wav")
    with wave.open(str(tmp_path / "empty.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    with pytest.raises(ValueError, match="empty"):
        load_wav_16k(tmp_path / "empty.wav")
