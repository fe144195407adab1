"""The fallback transport (`transport: hls`): the character as MPEG-TS segments for Gradio's
streaming video, which plays them over HLS. It adds seconds of delay (segments, then the
player's own buffer), so WebRTC stays the default; this is for browsers that cannot open
the WebRTC connection.

Released frames reach `SegmentStream` from the live session's pump, like a WebRTC peer's;
every `seconds` of them become one H.264 + AAC segment, with timestamps that run on across
segments so the player joins them without gaps (one AAC encoder runs across them all, so the
audio neither overlaps nor gaps at a join).
"""

from __future__ import annotations

import queue
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import numpy as np

from engine.audio import SAMPLE_RATE
from engine.media import Mp4Writer, audio_encoder
from engine.realtime import AVFrame


class SegmentStream:
    """Frames of one live session -> numbered .ts files under `folder`; `segments()` yields their paths."""

    def __init__(self, live, folder: str | Path, fps: int, *, seconds: float = 1.0, keep: int = 12):
        if seconds <= 0:
            raise ValueError(f"segment length must be positive, got {seconds}")
        self.live, self.fps = live, fps
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.frames_per_segment = max(1, round(seconds * fps))
        self.keep = keep
        self._queue: queue.Queue[AVFrame] = queue.Queue(maxsize=10 * self.frames_per_segment)
        self._closed = threading.Event()
        # Timestamps start one second in: the AAC encoder's priming would push the first segment's
        # audio below zero, and the muxer would then shift that segment alone.
        self._frames_written = fps
        self._samples_written = SAMPLE_RATE
        self._audio_encoder = audio_encoder()  # one for the stream, so that segments' audio neither overlaps nor gaps
        self._written: list[Path] = []
        live.add_listener(self._on_frame, self._on_turn)

    def _on_frame(self, frame: AVFrame, t: float) -> None:
        try:
            self._queue.put_nowait(frame)
        except queue.Full:  # nobody is pulling segments: drop rather than hold up the pump
            pass

    def _on_turn(self, turn_id: int, t: float) -> None:
        pass

    def close(self) -> None:
        self._closed.set()
        self.live.remove_listener(self._on_frame, self._on_turn)

    def segments(self, poll_s: float = 0.5) -> Iterator[str]:
        """Paths of finished segments, until `close()` or the session's end (looked for every `poll_s` while no
        frame comes). No deadline for frames: a first step that compiles kernels or captures a CUDA graph may
        take minutes, and the player waits for it."""
        index, carried = 0, []
        while True:
            # one frame more than a segment holds: it tells this segment is not the session's last
            frames, carried = carried, []
            while len(frames) <= self.frames_per_segment and not self._closed.is_set():
                try:
                    frames.append(self._queue.get(timeout=poll_s))
                except queue.Empty:
                    if self.live.closed.is_set():  # the session stopped: its last frames make the last segment
                        self._closed.set()
            if not frames:
                return
            frames, carried = frames[:self.frames_per_segment], frames[self.frames_per_segment:]
            path = self.folder / f"segment_{index:05d}.ts"
            self._write(path, frames, last=self._closed.is_set() and not carried)
            index += 1
            self._written.append(path)
            while len(self._written) > self.keep:  # the player has long fetched these
                self._written.pop(0).unlink(missing_ok=True)
            yield str(path)

    def _write(self, path: Path, frames: list[AVFrame], last: bool = False) -> None:
        with Mp4Writer(path, self.fps, frames[0].rgb.shape[:2], container_format="mpegts",
                       first_frame=self._frames_written, first_sample=self._samples_written,
                       audio_encoder=self._audio_encoder) as writer:
            for frame in frames:
                writer.write(frame.rgb, frame.pcm)
            if last:  # the audio the shared encoder still holds goes into the last segment
                writer.flush_audio_encoder()
        self._frames_written, self._samples_written = writer.frames, writer.samples  # running on from this segment


class LiveSegments:
    """The page's one segment stream: of whichever session is live when `stream()` is called."""

    def __init__(self, controller, fps: int, root: str | Path | None = None):
        self.controller, self.fps = controller, fps
        self.root = Path(root) if root is not None else Path(tempfile.gettempdir()) / "talkloop-hls"
        self._current: SegmentStream | None = None

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def stream(self) -> Iterator[str]:
        """Segment paths of the live session until it stops or another stream replaces this one."""
        self.close()
        live = self.controller.live
        if live is None:
            return
        stream = self._current = SegmentStream(live, self.root / live.session_id, self.fps)
        try:
            yield from stream.segments()
        finally:
            stream.close()


def mic_chunk_to_float(chunk) -> tuple[np.ndarray, int] | None:
    """Gradio's streaming microphone value (sample_rate, int16 or float array, mono or stereo) -> mono float32."""
    if chunk is None:
        return None
    sample_rate, data = chunk
    data = np.asarray(data)
    if data.size == 0:
        return None
    scale = float(np.iinfo(data.dtype).max) if np.issubdtype(data.dtype, np.integer) else 1.0
    data = data.astype(np.float32) / scale
    if data.ndim == 2:
        data = data.mean(axis=1)
    return data, int(sample_rate)
