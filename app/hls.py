"""The fallback transport (`transport: hls`): the character as MPEG-TS segments for Gradio's
streaming video, which plays them over HLS. It adds seconds of delay (segments, then the
player's own buffer), so WebRTC stays the default; this is for browsers that cannot open
the WebRTC connection.

Released frames reach `SegmentStream` from the live session's pump, like a WebRTC peer's;
every `seconds` of them become one H.264 + AAC segment, with timestamps that run on across
segments so the player joins them without gaps (one AAC encoder runs across them all, so the
audio neither overlaps nor gaps at a join).

Each stream writes into a folder of its own under the root (`<tmp>/talkloop-hls`) and removes it once the stream
is over: Gradio reads every segment into memory as it is yielded and serves the player from there, so no folder is
read from once its stream has ended. What streams left at the app's exit goes then; what a run of the app that died
left goes when the next run starts, told apart by an owner lock that no running stream holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE
from engine.media import Mp4Writer, audio_encoder
from engine.realtime import AVFrame

try:
    import fcntl
except ImportError:  # no flock (Windows): folders are removed by their own streams and at exit, never swept
    fcntl = None

log = logging.getLogger(__name__)

# In each stream folder, locked (flock) while the process whose stream writes there runs: a folder whose lock
# nobody holds was left by a run of the app that died.
OWNER_LOCK = "owner.lock"


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
        self._delete_failed = False
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
                self._delete(self._written.pop(0))
            yield str(path)

    def _delete(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a segment left on disk is no reason to stop the stream; said once, not every second
            if not self._delete_failed:
                log.warning("could not delete the HLS segment %s (%s); the stream carries on", path, e)
            self._delete_failed = True

    def _write(self, path: Path, frames: list[AVFrame], last: bool = False) -> None:
        with Mp4Writer(path, self.fps, frames[0].rgb.shape[:2], container_format="mpegts",
                       first_frame=self._frames_written, first_sample=self._samples_written,
                       audio_encoder=self._audio_encoder) as writer:
            for frame in frames:
                writer.write(frame.rgb, frame.pcm)
            if last:  # the audio the shared encoder still holds goes into the last segment
                writer.flush_audio_encoder()
        self._frames_written, self._samples_written = writer.frames, writer.samples  # running on from this segment


def _hold(folder: Path) -> int | None:
    """Lock `folder` as a running stream's: its owner lock, locked before it gets its name, so that a run of the app
    starting meanwhile never finds it unlocked. The descriptor to keep open; None where the file system cannot lock
    (the folder is then never swept, only removed by its stream or at exit)."""
    if fcntl is None:
        return None
    pending = folder / f"{OWNER_LOCK}.pending"
    try:
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, folder / OWNER_LOCK)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(pending)
        return None
    return fd


def _take_if_abandoned(folder: Path) -> int | None:
    """The descriptor of `folder`'s owner lock, locked, where no running stream holds it; else None (no lock file:
    not a stream folder, or one whose stream is only starting)."""
    try:
        fd = os.open(folder / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{OWNER_LOCK} is not a file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_folder(folder: Path) -> bool:
    """Delete a stream folder: its segments, then its owner lock (so that a folder only partly removed is still found
    by the next run's sweep), then the folder. A folder inside it is not the app's and stays. False where anything
    stayed, said in one warning."""
    failures: list[OSError] = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return True
    except OSError as e:
        entries, failures = [], [e]
    lock_file = None
    for entry in entries:
        if entry.name == OWNER_LOCK:
            lock_file = entry.path
        elif entry.is_dir(follow_symlinks=False):
            failures.append(IsADirectoryError(f"{entry.name} is a folder, not a segment"))
        else:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                failures.append(e)
    if not failures:
        try:
            if lock_file is not None:
                os.unlink(lock_file)
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append(e)
    if failures:
        more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
        log.warning("could not remove the HLS segment folder %s (%s%s); the next start tries again", folder, failures[0], more)
        return False
    return True


class _StreamFolders:
    """The stream folders this process made under `root` and has not removed yet, each with its owner lock held."""

    def __init__(self, root: Path):
        self.root = root
        self._held: dict[Path, int | None] = {}  # folder -> the descriptor holding its owner lock
        self._lock = threading.Lock()

    def make(self, session_id: str) -> Path:
        if not session_id or session_id in (".", "..") or Path(session_id).name != session_id:
            raise ValueError(f"session id {session_id!r} cannot name a folder under {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        # a name of its own: a second stream of the same session never shares (nor removes) the first one's folder
        folder = Path(tempfile.mkdtemp(prefix=f"{session_id}-", dir=self.root)).absolute()
        with self._lock:
            self._held[folder] = _hold(folder)
        return folder

    def remove(self, folder: Path) -> None:
        """Remove a folder made here, unless that was done already. One that cannot be removed is let go, its owner
        lock released: the next run's sweep tries again."""
        with self._lock:
            if folder not in self._held:
                return
            fd = self._held.pop(folder)
            if folder.parent == self.root:  # never anything outside the root
                _remove_folder(folder)
            if fd is not None:
                os.close(fd)

    def remove_all(self) -> None:
        for folder in list(self._held):
            self.remove(folder)

    def remove_abandoned(self) -> None:
        """Remove the folders that runs of the app which died left under the root: those whose owner lock no running
        stream (of this process or another) holds. Anything else under the root stays."""
        if fcntl is None:
            return
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("could not look for leftover HLS segment folders in %s: %s", self.root, e)
            return
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            folder = Path(entry.path)
            fd = _take_if_abandoned(folder)
            if fd is not None:
                try:
                    _remove_folder(folder)
                finally:
                    os.close(fd)


class LiveSegments:
    """The page's one segment stream: of whichever session is live when `stream()` is called. A stream's folder
    goes when the stream is over; those of streams still open go at exit; those that runs of the app which died
    left go when this one starts."""

    def __init__(self, controller, fps: int, root: str | Path | None = None):
        self.controller, self.fps = controller, fps
        self.root = (Path(root) if root is not None else Path(tempfile.gettempdir()) / "talkloop-hls").absolute()
        self._current: SegmentStream | None = None
        self._folders = _StreamFolders(self.root)
        self._folders.remove_abandoned()
        weakref.finalize(self, self._folders.remove_all)  # at exit: a stream Gradio never resumed nor closed

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
        folder = self._folders.make(live.session_id)
        try:
            stream = self._current = SegmentStream(live, folder, self.fps)
        except BaseException:
            self._folders.remove(folder)
            raise
        try:
            yield from stream.segments()
        finally:
            # ended, replaced or closed by Gradio: it read each segment as it was yielded and reads none again
            stream.close()
            self._folders.remove(folder)


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
