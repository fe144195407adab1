"""Streaming voice activity detection with Silero VAD v6.

The ONNX model is the one faster-whisper ships (faster_whisper/assets), run on
onnxruntime: no torch, no download. The model reads 512-sample windows (32 ms at
16 kHz) plus 64 samples of context and carries an LSTM state, so feeding it one
window at a time gives exactly the probabilities of a whole-file pass.

The segmenter follows silero's own get_speech_timestamps rules (threshold /
neg_threshold hysteresis, min_silence_ms before a segment ends, speech_pad_ms
around it) but decides online, window by window, and reports sample indices
counted from the first sample ever fed.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from engine.audio import SAMPLE_RATE

WINDOW = 512
CONTEXT = 64


@functools.lru_cache(maxsize=1)
def _silero_session():
    import onnxruntime
    from faster_whisper.utils import get_assets_path

    opts = onnxruntime.SessionOptions()
    # One window is ~0.1 ms of work: extra threads only add wake-up cost.
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    path = os.path.join(get_assets_path(), "silero_vad_v6.onnx")
    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"], sess_options=opts)


class SileroModel:
    """Window-by-window Silero VAD with its recurrent state."""

    def __init__(self) -> None:
        self._session = _silero_session()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)

    def __call__(self, window: np.ndarray) -> float:
        """Speech probability of one 512-sample window."""
        frame = np.concatenate([self._context, window])[None, :]
        with self._lock:
            prob, self._h, self._c = self._session.run(None, {"input": frame, "h": self._h, "c": self._c})
        self._context = window[-CONTEXT:].copy()
        return float(prob.reshape(-1)[0])


@dataclass(frozen=True)
class VADConfig:
    """Parameters named as silero-vad users know them."""

    threshold: float = 0.5  # probability at or above which a window is speech
    neg_threshold: float | None = None  # below this a window is silence; default threshold - 0.15
    # Silence that ends a turn. On 2 CPU cores the final decode (~0.36 s) starts at the
    # first silent window and outlasts this wait, so a shorter wait would not answer
    # sooner there; a longer one would add to every turn's latency.
    min_silence_ms: int = 300
    speech_pad_ms: int = 200  # audio kept before the first / after the last voiced window (pre-roll)
    min_speech_ms: int = 64  # voiced run that starts a segment (rejects clicks)
    max_speech_s: float = 30.0  # a segment is cut here so one turn stays bounded

    def __post_init__(self) -> None:
        # A threshold typed as a percentage (50) would never trigger; refuse it rather than hear nothing.
        problems = [
            f"{name} must be between 0 and 1, got {value}"
            for name, value in (("threshold", self.threshold), ("neg_threshold", self.neg_threshold))
            if value is not None and not 0.0 < value < 1.0
        ]
        problems += [
            f"{name} must be >= 0, got {value}"
            for name, value in (("min_silence_ms", self.min_silence_ms), ("speech_pad_ms", self.speech_pad_ms), ("min_speech_ms", self.min_speech_ms))
            if not value >= 0
        ]
        if not self.max_speech_s > 0:
            problems.append(f"max_speech_s must be > 0, got {self.max_speech_s}")
        if problems:
            raise ValueError("VADConfig: " + "; ".join(problems))

    def silence_threshold(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(self.threshold - 0.15, 0.01)


@dataclass(frozen=True)
class VADEvent:
    """kind is 'start' (speech began), 'pause' (a silence began inside speech, the
    turn may be ending), or 'end' (the segment is over). start/end are sample
    indices of the padded segment; last_voiced is the end of its last voiced window."""

    kind: str
    start: int
    end: int = -1
    last_voiced: int = -1
    reason: str = ""


class StreamingVAD:
    """Online speech segmenter over 16 kHz mono float32 chunks of any size."""

    def __init__(self, config: VADConfig | None = None, model: SileroModel | None = None) -> None:
        self.config = config or VADConfig()
        self.model = model or SileroModel()
        self._clear_state()

    def _clear_state(self) -> None:
        self._pending = np.zeros(0, dtype=np.float32)
        self.samples_seen = 0  # samples fed so far (absolute clock of the stream)
        self.windows_seen = 0
        self.triggered = False
        self.last_prob = 0.0
        self._voiced_run = 0
        self._run_start = 0
        self._segment_start = 0
        self._speech_start = 0
        self._last_voiced = 0
        self._silence_start = 0  # 0: no silence under way
        self._previous_end = 0

    @property
    def in_speech(self) -> bool:
        return self.triggered

    @property
    def last_voiced(self) -> int:
        """End (sample index) of the last window at or above threshold."""
        return self._last_voiced

    @property
    def silence_start(self) -> int:
        """Where the silence under way inside a segment began; 0 when there is none."""
        return self._silence_start if self.triggered else 0

    def reset(self) -> None:
        """Start over as if nothing had been fed (sample indices restart at 0)."""
        self._clear_state()
        self.model.reset()

    def process(self, chunk: np.ndarray) -> list[VADEvent]:
        """Feed 16 kHz mono float32 samples; return the events they completed."""
        events: list[VADEvent] = []
        self.samples_seen += chunk.shape[0]
        data = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        usable = (data.shape[0] // WINDOW) * WINDOW
        for offset in range(0, usable, WINDOW):
            event = self._step(data[offset : offset + WINDOW])
            if event is not None:
                events.extend(event)
        self._pending = data[usable:].copy()
        return events

    def _step(self, window: np.ndarray) -> list[VADEvent] | None:
        cfg = self.config
        prob = self.model(window)
        self.last_prob = prob
        begin = self.windows_seen * WINDOW
        end = begin + WINDOW
        self.windows_seen += 1
        pad = cfg.speech_pad_ms * SAMPLE_RATE // 1000
        if not self.triggered:
            if prob >= cfg.threshold:
                if self._voiced_run == 0:
                    self._run_start = begin
                self._voiced_run += 1
                if self._voiced_run * WINDOW * 1000 >= cfg.min_speech_ms * SAMPLE_RATE:
                    self.triggered = True
                    self._speech_start = self._run_start
                    # Never reach back into the previous segment.
                    self._segment_start = max(self._run_start - pad, self._previous_end, 0)
                    self._last_voiced = end
                    self._silence_start = 0
                    return [VADEvent("start", self._segment_start, last_voiced=end)]
            else:
                self._voiced_run = 0
            return None

        events: list[VADEvent] = []
        if prob >= cfg.threshold:
            self._last_voiced = end
            self._silence_start = 0
        elif prob < cfg.silence_threshold() and not self._silence_start:
            self._silence_start = begin
            events.append(VADEvent("pause", self._segment_start, end=begin, last_voiced=self._last_voiced))
        min_silence = cfg.min_silence_ms * SAMPLE_RATE // 1000
        if self._silence_start and end - self._silence_start >= min_silence:
            events.append(self._close(min(self._silence_start + pad, end), "silence"))
        elif end - self._speech_start >= cfg.max_speech_s * SAMPLE_RATE:
            events.append(self._close(end, "max_speech_s"))
        return events or None

    def end_segment(self) -> VADEvent | None:
        """End the segment under way here, as decided outside the VAD (a semantic end of turn): the next voiced run
        starts a new one."""
        if not self.triggered:
            return None
        pad = self.config.speech_pad_ms * SAMPLE_RATE // 1000
        return self._close(min(self._last_voiced + pad, self.windows_seen * WINDOW), "ended")

    def _close(self, end: int, reason: str) -> VADEvent:
        event = VADEvent("end", self._segment_start, end=end, last_voiced=self._last_voiced, reason=reason)
        self.triggered = False
        self._voiced_run = 0
        self._silence_start = 0
        self._previous_end = end
        return event


def speech_segments(audio: np.ndarray, config: VADConfig | None = None) -> list[tuple[int, int]]:
    """Whole-signal helper: (start, end) sample pairs of the speech segments in audio."""
    vad = StreamingVAD(config)
    segments: list[tuple[int, int]] = []
    for event in vad.process(audio):
        if event.kind == "end":
            segments.append((event.start, event.end))
    # Flush: enough silence to close a segment still open at the end of the audio.
    if vad.triggered:
        tail = np.zeros(vad.config.min_silence_ms * SAMPLE_RATE // 1000 + 2 * WINDOW, dtype=np.float32)
        for event in vad.process(tail):
            if event.kind == "end":
                segments.append((event.start, min(event.end, audio.shape[0])))
    return segments
