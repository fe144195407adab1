"""MP4 (H.264 + AAC) out, through PyAV's bundled FFmpeg. (Audio files in: `engine.audio.read_audio`.)"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from engine.audio import SAMPLE_RATE


def audio_encoder(sample_rate: int = SAMPLE_RATE) -> av.CodecContext:
    """A mono AAC encoder to share between consecutive `Mp4Writer` segments."""
    encoder = av.CodecContext.create("aac", "w")
    encoder.sample_rate, encoder.layout, encoder.format = sample_rate, "mono", "fltp"
    encoder.time_base = Fraction(1, sample_rate)
    encoder.open()
    return encoder


class Mp4Writer:
    """Streams RGB frames and their audio (H.264 + AAC) into a fragmented MP4.

    Fragmented (empty moov, a fragment per keyframe) so that a file cut short by a
    crash still plays up to its last fragment. With `container_format="mpegts"` it writes
    an MPEG-TS segment instead, its timestamps starting at `first_frame` / `first_sample`
    so that consecutive segments join without gaps; for their audio to join too, give each segment
    the same `audio_encoder` (`audio_encoder()`): a new AAC encoder would start each segment with
    its priming (64 ms early) and end it padded, so that neighbours overlap.
    """

    def __init__(self, path: str | Path, fps: int, size: tuple[int, int], sample_rate: int = SAMPLE_RATE, *,
                 container_format: str | None = None, first_frame: int = 0, first_sample: int = 0,
                 audio_encoder: av.CodecContext | None = None):
        self.path = Path(path)
        if len(size) != 2 or any(not isinstance(n, (int, np.integer)) or n <= 0 or n % 2 for n in size):
            # H.264 in 4:2:0 takes whole chroma pairs; FFmpeg would say only "generic error" at the first frame
            raise ValueError(f"video size {tuple(size)} must be (height, width), two positive even integers")
        if self.path.is_dir():  # FFmpeg would find out only at the first packet, after the work that made it
            raise IsADirectoryError(f"cannot write a video to {self.path}: it is a folder")
        # flush_packets: each fragment reaches the file when it is muxed, not when FFmpeg's IO buffer fills
        options = {"flush_packets": "1"}
        if container_format is None:
            options["movflags"] = "frag_keyframe+empty_moov+default_base_moof"
        # MP4 unless told otherwise, whatever the file's name ends with
        self.container = av.open(str(self.path), "w", format=container_format or "mp4", options=options)
        h, w = self.size = tuple(size)
        try:
            self.video = self.container.add_stream("libx264", rate=fps)
            self.video.width, self.video.height, self.video.pix_fmt = w, h, "yuv420p"
            self.video.options = {"preset": "veryfast", "tune": "zerolatency", "g": str(fps)}
            self.audio = self.container.add_stream("aac", rate=sample_rate)
            self.audio.layout = "mono"
        except BaseException:  # no writer comes back to close it: its file's descriptor would stay held
            self.container.close()
            raise
        # the caller's encoder runs on across files: its packets go into this file's stream, its tail into the next
        self.audio_encoder = audio_encoder
        self.sample_rate = sample_rate
        self.frames = first_frame  # the next video frame's timestamp, in frames
        self.samples = first_sample  # the next audio frame's timestamp, in samples
        self._closed = False

    def write(self, rgb: np.ndarray, pcm: np.ndarray) -> None:
        if rgb.shape != (*self.size, 3):  # the encoder would scale it to the video's size without a word
            raise ValueError(f"frame of shape {rgb.shape} does not fit the video: (height, width, 3) = {(*self.size, 3)}")
        vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        vf.pts = self.frames
        self.frames += 1
        for packet in self.video.encode(vf):
            self.container.mux(packet)
        if pcm.size:
            af = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32).reshape(1, -1), format="flt", layout="mono")
            af.sample_rate, af.pts = self.sample_rate, self.samples
            self.samples += pcm.size
            if self.audio_encoder is None:
                packets = self.audio.encode(af)
            else:
                af.time_base = Fraction(1, self.sample_rate)
                packets = self.audio_encoder.encode(af)
            for packet in packets:
                packet.stream = self.audio
                self.container.mux(packet)

    def flush_audio_encoder(self) -> None:
        """The shared `audio_encoder`'s remaining audio into this file: for the last of the files it runs across."""
        for packet in self.audio_encoder.encode(None):
            packet.stream = self.audio
            self.container.mux(packet)

    def close(self) -> None:
        """Flush the encoders and close the file; closing twice is harmless. The file is closed whatever the flush
        raised (a full disk): PyAV's finaliser would not close it, so its descriptor and blocks would stay held."""
        if self._closed:
            return
        self._closed = True
        try:
            for stream in (self.video, self.audio) if self.audio_encoder is None else (self.video,):
                for packet in stream.encode(None):
                    self.container.mux(packet)
        except BaseException as flush_error:
            try:
                self.container.close()
            except (OSError, av.error.FFmpegError) as close_error:  # the flush's error is the one to raise
                flush_error.add_note(f"closing {self.path} failed too: {close_error}")
            raise
        self.container.close()

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
