"""The real-time character: a loop that never stops stepping, and synchronized A/V out.

In the spirit of LiveKit's avatar VideoGenerator:

    character = RealtimeCharacter(session, codec)
    character.start()
    character.push_audio(pcm, sample_rate)   # speech to say; placed at the next frame not yet made
    character.listen(mic_pcm_16k)            # the user's voice as it arrives: the character listens
    character.clear()                        # barge-in: drop speech not yet played
    for frame in character.frames():         # AVFrame: RGB, its 1/24 s of audio, speaking flag
        ...
    character.stop()

While nobody speaks the engine steps on silence, so the frame clock never stops. Each
frame carries exactly the audio it was generated from, so picture and sound leave the
playout buffer together.

With `hold_when_late`, an engine slower than real time never stalls the voice: before a
step whose frames would arrive after their time, the frames in between go out at once as
the last picture held with their own audio, and the step makes the frames after them.
The sound keeps the 24 fps clock; the picture changes as often as the engine can.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import torch

from engine.audio import SAMPLE_RATE, frame_of_sample, frame_sample, to_mono_16k
from engine.codec import Codec, decode_step
from engine.listen import ListeningTrack
from engine.mel import log_mel_frames
from engine.playout import PlayoutBuffer
from engine.session import EngineSession
from engine.session_log import record_session

_SPEECH_RMS = 1e-4  # below this a frame's audio counts as silence
log = logging.getLogger(__name__)


def _silenced(frame: "AVFrame") -> "AVFrame":
    """The frame with its audio zeroed, as a barge-in leaves a frame already made."""
    return replace(frame, pcm=np.zeros_like(frame.pcm), speaking=False)


def blend_group_start(first: np.ndarray, before: np.ndarray, weight: float) -> np.ndarray:
    """A step's first frame, `weight` of the way to the frame made just before it (uint8 (H, W, 3)). The codec draws
    a step's 4 frames around one latent, and the picture moves more from one latent to the next than between
    frames; blended, that move comes in two parts, and the mouth moves at 24 Hz rather than in steps at 6."""
    mixed = (1.0 - weight) * first.astype(np.float32) + weight * before.astype(np.float32)
    return np.clip(np.rint(mixed), 0, 255).astype(np.uint8)


def _held_frames(first: int, rgb: np.ndarray, pcms: list[np.ndarray]) -> list["AVFrame"]:
    """Frames from `first` on that show `rgb` again, each with its own audio."""
    return [AVFrame(first + i, rgb, pcm, bool(np.sqrt(np.mean(pcm**2)) > _SPEECH_RMS), held=True) for i, pcm in enumerate(pcms)]


@dataclass(frozen=True)
class AVFrame:
    index: int  # video frame number in the session
    rgb: np.ndarray  # (H, W, 3) uint8
    pcm: np.ndarray  # (samples,) float32 at 16 kHz: this frame's 1/fps s of audio
    speaking: bool
    held: bool = False  # the picture before it, held: the engine was too slow to make this one in time


class AudioTimeline:
    """16 kHz PCM laid on the video frame clock; silence wherever nothing was pushed.

    The one copy of the character's speech: each step's audio features are computed from it
    (`features`) and handed to the step, and each frame's sound is cut from it (`frame_pcm`).
    """

    def __init__(self, fps: int):
        self.fps = fps
        self.start_frame = 0  # frame whose first sample is self.pcm[0]
        self.pcm = np.zeros(0, dtype=np.float32)
        self.speech_end = 0  # sample after the last pushed speech

    def _offset(self, sample: int) -> int:
        return sample - frame_sample(self.start_frame, self.fps)

    def push(self, pcm: np.ndarray, not_before_frame: int) -> int:
        """Append speech after what was pushed before (not earlier than a frame); returns its first frame."""
        start = max(self.speech_end, frame_sample(not_before_frame, self.fps))
        end = start + pcm.size
        need = self._offset(end)
        if need > self.pcm.size:
            self.pcm = np.concatenate([self.pcm, np.zeros(need - self.pcm.size, np.float32)])
        self.pcm[self._offset(start):need] = pcm
        self.speech_end = end
        return frame_of_sample(start, self.fps)

    def clear_from(self, frame: int) -> None:
        """Silence everything from `frame` on."""
        cut = max(self._offset(frame_sample(frame, self.fps)), 0)
        self.pcm = self.pcm[:cut]
        self.speech_end = min(self.speech_end, frame_sample(frame, self.fps))

    def frame_pcm(self, frame: int) -> np.ndarray:
        a, b = self._offset(frame_sample(frame, self.fps)), self._offset(frame_sample(frame + 1, self.fps))
        out = np.zeros(b - a, np.float32)
        lo, hi = max(a, 0), min(b, self.pcm.size)
        if hi > lo:
            out[lo - a:hi - a] = self.pcm[lo:hi]
        return out

    def features(self, first_frame: int, n_frames: int, n_mels: int) -> torch.Tensor:
        return log_mel_frames(self.pcm, n_mels, first_frame, n_frames, self.fps, pcm_start_frame=self.start_frame)

    def drop_before(self, frame: int) -> None:
        if frame > self.start_frame:
            cut = min(self._offset(frame_sample(frame, self.fps)), self.pcm.size)
            self.pcm = self.pcm[cut:]
            self.start_frame = frame


class LocalSteps:
    """Steps made in this process: the session denoises (on the window it is handed), the codec decodes,
    one after the other; an audio-conditioned codec gets its rows of the same window (`decode_step`), and a
    listening codec the step's rows of the user's voice."""

    def __init__(self, session: EngineSession, codec: Codec):
        self.session, self.codec, self.spec = session, codec, session.spec
        self.device = str(session.device)
        self._done: deque[np.ndarray] = deque()

    @property
    def started(self) -> bool:
        return self.session.started

    @property
    def next_frame(self) -> int:
        return self.session.next_frame

    @property
    def steps_done(self) -> int:
        return self.session.steps_done

    @property
    def reset_every(self) -> int:
        return self.session.reset_every

    def submit(self, features: torch.Tensor, window_start: int, listen: torch.Tensor | None = None) -> None:
        """Make one step on `features` (its audio window) and decode it with `listen` (4, LISTEN_FEATURES) rows
        of the user's voice (None: silence)."""
        if window_start != self.session.next_frame - self.spec.audio_context:
            raise ValueError(f"features for frames {window_start} on do not start the window of the session's next step "
                             f"(frame {self.session.next_frame - self.spec.audio_context})")
        latent = self.session.step(features)
        self._done.append(decode_step(self.codec, latent, features, self.spec, listen).cpu().numpy())

    def collect(self) -> np.ndarray:
        return self._done.popleft()


class RemoteSteps:
    """Steps made by a `DistributedEngine` (tensor-parallel ranks, decoder processes)."""

    def __init__(self, engine):
        self.engine, self.spec = engine, engine.spec
        self.device = f"gpus {list(engine.placement.diffusion)}" if engine.placement.diffusion else f"cpu x{engine.placement.tp}"
        self.started = False

    def start(self, reference_latent: torch.Tensor) -> None:
        self.engine.start(reference_latent)
        self.started = True

    @property
    def next_frame(self) -> int:
        return self.engine.submitted * self.spec.frames_per_latent

    @property
    def steps_done(self) -> int:
        return self.engine.submitted

    @property
    def reset_every(self) -> int:
        return self.engine.reset_every

    def submit(self, features: torch.Tensor, window_start: int, listen: torch.Tensor | None = None) -> None:
        self.engine.submit_step(features, window_start, listen)

    def collect(self) -> np.ndarray:
        return self.engine.next_frames()[1].numpy()


class RealtimeCharacter:
    """`lookahead` steps are submitted before their frames are collected: with a remote engine,
    step t+1 is denoised while step t is decoded. Speech pushed after a step was submitted
    starts at the next step; barge-in also silences submitted steps not yet played. The user's voice
    (`listen`) reaches each step's decode as the rows of the frames heard last when it is submitted."""

    # With adaptive_lead, the playout lead follows the slowest of the last LEAD_WINDOW steps (8 s of video) or
    # of one reset period and a few steps, whichever is longer, so a position reset is always among them, once
    # the window is full; the first ADAPT_AFTER steps (warm-up, graph capture) are left out. Until then the
    # lead is the buffer's max_lead. A step's time runs from room in the buffer to its frames in hand (with a
    # step in flight, `lookahead`, that is from submitting the next one), which is what the lead must cover.
    LEAD_WINDOW, ADAPT_AFTER = 48, 8
    # With hold_when_late, a step's frames are expected after (1 + lookahead) times the slowest of the last
    # HOLD_WINDOW steps, times HOLD_MARGIN, plus one frame.
    HOLD_WINDOW, HOLD_MARGIN = 1, 1.25
    STOP_WAIT_S = 10.0  # stop() waits this long for the step in flight (a first step may compile, capture a graph)

    def __init__(self, session: EngineSession | None = None, codec: Codec | None = None, *,
                 steps: LocalSteps | RemoteSteps | None = None, playout: PlayoutBuffer | None = None, lookahead: int = 0,
                 adaptive_lead: bool = False, hold_when_late: bool = False, group_blend: float = 0.0):
        if not 0.0 <= group_blend < 1.0:
            raise ValueError(f"group_blend must be in [0, 1), got {group_blend}")
        if steps is None:
            if session is None or codec is None:
                raise ValueError("give a session and a codec, or steps")
            steps = LocalSteps(session, codec)
        self.steps, self.spec, self.session = steps, steps.spec, session
        self.lookahead = lookahead
        self.adaptive_lead = adaptive_lead
        self.hold_when_late = hold_when_late
        self.group_blend = group_blend
        self._made_last: np.ndarray | None = None  # the last frame the engine made (blend_group_start)
        # step times after the first ADAPT_AFTER; at least one reset period (the session's) plus a few steps long
        self._lead_window: deque[float] = deque(maxlen=max(self.LEAD_WINDOW, steps.reset_every + 6))
        self._warm_steps_skipped = 0
        self._pending: deque[tuple[int, list[np.ndarray], int]] = deque()  # submitted steps: first frame, audio, step
        self.playout = playout or PlayoutBuffer(fps=self.spec.fps)
        self.timeline = AudioTimeline(self.spec.fps)
        self.listening = ListeningTrack(self.spec.fps)  # the user's voice, pushed by listen() from the app's thread
        self.step_seconds: deque[float] = deque(maxlen=1024)
        # Hooks for soak runs and fault injection: before_step(step) runs in the engine thread before a step is
        # submitted (its time counts as the step's); on_step(step, seconds) when that step's frames are in.
        self.before_step: Callable[[int], None] | None = None
        self.on_step: Callable[[int, float], None] | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._clears = 0  # barge-ins so far: a step taken off _pending before the latest one is silenced on its way in
        self._unsubmitted = 0  # first frame of the next step not yet submitted (a step may be in flight)
        # Frames are numbered on the sound's clock; the session numbers only those it made. They differ by the
        # frames held in its place (hold_when_late).
        self._skipped = 0
        self._put_until = 0  # the frame after the last one put into the playout buffer
        self._last_rgb: np.ndarray | None = None
        self.frames_held = 0
        self._recent_held: deque[bool] = deque(maxlen=self.playout.stats.recent.maxlen)
        self._held_released = 0
        self._running = threading.Event()
        self._thread: threading.Thread | None = None

    # Control ---------------------------------------------------------------------
    def start(self) -> None:
        if not self.steps.started:
            raise ValueError("start the engine session with a reference before the character")
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name="talkloop-engine", daemon=True)
        self._thread.start()

    def stop(self, session_log: str | None = None) -> dict:
        """Stop the loop; the session's figures are appended to `session_log` when given. Returns them; a log that
        cannot be written is named in their "session_log_error", not raised."""
        self._running.clear()
        self.playout.close()
        still_running = False
        if self._thread is not None:
            self._thread.join(timeout=self.STOP_WAIT_S)
            still_running = self._thread.is_alive()
            if still_running:  # it ends after its step; whoever reuses the engine's model should know
                log.warning("the engine loop is still in a step %.0f s after stop(); it ends after that step", self.STOP_WAIT_S)
        stats = self.stats()
        if still_running:
            stats["loop_still_running_at_stop"] = True
        p = self.playout.stats
        stats["seconds"] = (p.last_release - p.first_release) if p.first_release is not None else 0.0
        if session_log is not None:
            try:
                record_session(stats, session_log)
            except OSError as e:  # a full disk or a bad log path costs the log line, not the figures returned
                stats["session_log_error"] = f"session figures not written to {session_log}: {e}"
                log.error("%s", stats["session_log_error"])
        return stats

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> float:
        """Queue speech (any rate, mono or (samples, channels)); it starts at the next frame not yet made, or after
        the speech queued before it. Returns when its first sample is expected to play, on the playout buffer's
        clock (time.monotonic by default): every frame before it released one per 1/fps from the next release."""
        pcm = to_mono_16k(pcm, sample_rate)
        with self._lock:  # not into a step already submitted: its audio was taken when it was submitted
            self.timeline.push(pcm, self.next_frame)
            start = self.timeline.speech_end - pcm.size
            frame = frame_of_sample(start, self.spec.fps)
            next_frame, due = self._next_release()
            return due + (frame - next_frame) / self.spec.fps + (start - frame_sample(frame, self.spec.fps)) / SAMPLE_RATE

    def listen(self, pcm: np.ndarray) -> None:
        """The user's microphone audio as it arrives (16 kHz mono, float or int16, any chunk size): each step
        submitted after it decodes with the listening rows of the newest frames heard (a listening codec draws
        them; others ignore them). Thread-safe; the character's own speech does not belong here."""
        self.listening.push(pcm)

    @property
    def next_frame(self) -> int:
        """The first frame not yet submitted to the engine: where speech pushed now can start."""
        return max(self.steps.next_frame + self._skipped, self._unsubmitted)

    def _next_release(self) -> tuple[int, float]:
        """The next frame to be released and when (called with the lock held): the first waiting in the buffer,
        else the first of the steps in flight, else the next to be made. (For the moment between a step leaving
        _pending and its frames reaching the buffer, this names the frame after them: one step late.)"""
        head, due = self.playout.head()
        if head is not None:
            return head.index, due
        if self._pending:
            return self._pending[0][0], due
        return self.next_frame, due

    def clear(self) -> None:
        """Barge-in: speech not yet made is dropped, frames already waiting go silent, and so does the audio of
        every frame not yet released, so that the next steps' audio context holds no speech that was never heard."""
        with self._lock:
            self._clears += 1
            unheard_from, _ = self._next_release()  # never past the next frame not yet submitted
            self.timeline.clear_from(unheard_from)
            self._pending = deque((first, [np.zeros_like(p) for p in pcms], step) for first, pcms, step in self._pending)
        self.playout.map_waiting(_silenced)

    # Engine loop -------------------------------------------------------------------
    def make_step(self) -> list[AVFrame]:
        """Submit one engine step; return the 4 frames (with their audio) of the step now due,
        or none while the first `lookahead` steps are in flight. Also usable without the loop thread."""
        return self._make_step()[0]

    def _make_step(self) -> tuple[list[AVFrame], int]:
        """make_step's frames, and the count of barge-ins when their step left _pending."""
        spec = self.spec
        t0 = time.perf_counter()  # the audio features count as part of the step
        with self._lock:
            first = self.steps.next_frame + self._skipped
            late = self._frames_late(first) if self.hold_when_late else 0
            if late:
                self._hold(first, late)
                first += late
            self._unsubmitted = first + spec.frames_per_latent
            window_start = first - spec.audio_context
            features = self.timeline.features(window_start, spec.audio_window, spec.n_mels)
            step = self.steps.steps_done
            self._pending.append((first, [self.timeline.frame_pcm(first + i) for i in range(spec.frames_per_latent)], step))
            self.timeline.drop_before(min(first + spec.frames_per_latent - spec.audio_context - 1, self._put_until))
        if self.before_step is not None:
            self.before_step(step)
        heard = self.listening.latest(spec.frames_per_latent)  # the voice heard just before these frames are made
        self.steps.submit(features, window_start - self._skipped, heard)
        if len(self._pending) <= self.lookahead:
            return [], self._clears
        rgb = self.steps.collect()
        if len(rgb):
            if self.group_blend and self._made_last is not None:
                rgb = np.array(rgb)  # writable, whatever the steps handed back
                rgb[0] = blend_group_start(rgb[0], self._made_last, self.group_blend)
            self._made_last = rgb[-1]
        seconds = time.perf_counter() - t0
        self.step_seconds.append(seconds)
        with self._lock:
            first, pcms, step = self._pending.popleft()
            clears = self._clears
        if self.on_step is not None:
            self.on_step(step, seconds)
        made = len(rgb)
        return [
            AVFrame(first + i, rgb[i], pcm, bool(np.sqrt(np.mean(pcm**2)) > _SPEECH_RMS)) for i, pcm in enumerate(pcms[:made])
        ] + _held_frames(first + made, rgb[-1], pcms[made:]), clears

    def _frames_late(self, first: int) -> int:
        """How many frames from `first` on would be due before a step submitted now brings them (lock held):
        0 while playback (re)starts, or before any step's time is known."""
        due = self.playout.due_after_waiting()
        if due is None or self._last_rgb is None or not self.step_seconds:
            return 0
        recent = list(self.step_seconds)[-self.HOLD_WINDOW:]
        expected = self.playout.clock() + (1 + self.lookahead) * max(recent) * self.HOLD_MARGIN
        first_due = due + (first - self._put_until) * self.playout.period
        return max(0, math.ceil((expected - first_due) / self.playout.period) + 1)

    def _hold(self, first: int, count: int) -> None:
        """Frames first .. first+count-1 hold the picture before them, each with its own audio (lock held): put
        into the playout buffer now, or, with a step in flight, after its frames."""
        self._skipped += count
        pcms = [self.timeline.frame_pcm(index) for index in range(first, first + count)]
        if self._pending:
            self._pending[-1][1].extend(pcms)
            return
        assert self._last_rgb is not None
        self._put_locked(_held_frames(first, self._last_rgb, pcms))

    def _put(self, frames: list[AVFrame], clears: int) -> None:
        """Into the playout buffer; silenced if a barge-in came after their step left _pending (so that neither
        clear()'s pass over _pending nor its pass over the buffer saw them). Under the lock, so that a barge-in
        either comes before (and is seen here) or after (and its pass over the buffer sees them)."""
        with self._lock:
            if clears != self._clears:
                frames = [_silenced(f) for f in frames]
            self._put_locked(frames)

    def _put_locked(self, frames: list[AVFrame]) -> None:
        self.frames_held += sum(f.held for f in frames)
        if frames:
            self._put_until = frames[-1].index + 1
            self._last_rgb = frames[-1].rgb
        self.playout.put(frames)

    def _loop(self) -> None:
        try:
            while self._running.is_set():
                if not self.playout.wait_for_room(timeout=0.5):
                    continue
                frames, clears = self._make_step()
                self._put(frames, clears)
                if self.adaptive_lead and frames:
                    self._adapt_lead()
        except BaseException as e:  # surfaced to the consumer by frames()
            self.error = e
            self.playout.close()

    def _adapt_lead(self) -> None:
        """After each step: past the first ADAPT_AFTER steps (warm-up, graph capture), the lead covers
        the slowest step of the window."""
        if self._warm_steps_skipped < self.ADAPT_AFTER:
            self._warm_steps_skipped += 1
            return
        self._lead_window.append(self.step_seconds[-1])
        if len(self._lead_window) == self._lead_window.maxlen:
            self.playout.adapt_lead(max(self._lead_window))

    def frames(self, timeout: float = 5.0) -> Iterator[AVFrame]:
        """Frames on the 24 fps clock until stop(); raises if the engine loop died."""
        while True:
            batch = self.playout.get(timeout=timeout)
            if self.error is not None:
                raise RuntimeError(f"engine loop died: {self.error!r}") from self.error
            if not batch and self.playout.closed:
                return
            self._recent_held.extend(f.held for f in batch)
            self._held_released += sum(f.held for f in batch)
            yield from batch

    def stats(self) -> dict:
        steps = sorted(self.step_seconds)
        fps_recent = self.playout.stats.recent_fps(self.playout.clock(), self.playout.period)
        fps, released = self.playout.stats.fps(), self.playout.stats.released
        held = list(self._recent_held)
        pick = (lambda q: 1000 * steps[min(int(q * len(steps)), len(steps) - 1)]) if steps else (lambda q: 0.0)
        return {
            "steps": self.steps.steps_done,
            "step_ms_p50": pick(0.5),
            "step_ms_p95": pick(0.95),
            "fps": fps,
            # new pictures a second since the first frame (the rest held the picture before them)
            "video_fps": fps * (1 - self._held_released / released) if released else fps,
            "fps_recent": fps_recent,
            # new pictures a second among the frames released lately (the rest held the picture before them)
            "video_fps_recent": fps_recent * (1 - sum(held) / len(held)) if held else fps_recent,
            "frames_held": self.frames_held,
            "underruns": self.playout.stats.underruns,
            "buffer_depth": self.playout.stats.depth,
            "lead": self.playout.lead,
            "device": self.steps.device,
        }
