"""The user's voice as the character hears it: three numbers per video frame, the decoder's listening stream.

    track = ListeningTrack()
    track.push(mic_pcm_16k)          # as the microphone's audio arrives, any chunk size
    rows = track.latest(4)           # (4, LISTEN_FEATURES): the newest frames, for one step's decode

Per frame (1/24 s of the user's audio), from its loudness (RMS, dBFS, mapped to 0 .. 1):
`voice` follows it with a quarter-second lag (high while the user speaks, through the gaps
between words), `engaged` over about a second and a half (the user has been talking a while),
and `pause` = max(0, engaged - voice): high just after the user stops, which is when a
listener nods. All three are causal, so the stream can be computed as the audio arrives, and
`listening_features` over a whole clip equals the track fed in any chunks.

engine.character turns them into the renderer's listening motion (nods, brows raised, mouth
corners up, gaze at the camera); the audio decoder reads them and draws it.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from engine.audio import frame_sample

LISTEN_FEATURES = 3  # voice, engaged, pause
LOUDNESS_DB = (-50.0, -20.0)  # frame RMS (dBFS) mapped to loudness 0 .. 1
VOICE_S, ENGAGED_S = 0.25, 1.5  # time constants of the two followers


class ListeningTrack:
    """The listening features of a stream of 16 kHz mono audio, frame by frame as it arrives; thread-safe
    (the app pushes from its audio thread, the engine reads at each step)."""

    def __init__(self, fps: int = 24, keep: int = 96):
        self.fps, self.keep = fps, keep
        self._voice_alpha = 1.0 - math.exp(-1.0 / (fps * VOICE_S))
        self._engaged_alpha = 1.0 - math.exp(-1.0 / (fps * ENGAGED_S))
        self._pending = np.zeros(0, np.float32)
        self._frames = 0  # frames completed so far
        self._voice = self._engaged = 0.0
        self._rows: list[tuple[float, float, float]] = []
        self._lock = threading.Lock()

    @property
    def frames(self) -> int:
        return self._frames

    def push(self, pcm: np.ndarray) -> torch.Tensor:
        """Append audio (float in [-1, 1] or int16); -> the rows (n, LISTEN_FEATURES) of the frames it completed."""
        samples = np.asarray(pcm)
        if samples.ndim != 1:
            raise ValueError(f"listening audio must be 1-D mono 16 kHz samples, got shape {samples.shape}")
        if samples.dtype == np.int16:
            samples = samples.astype(np.float32) / 32768.0
        samples = samples.astype(np.float32, copy=False)
        if not np.isfinite(samples).all():
            raise ValueError("listening audio contains NaN or infinite values")
        with self._lock:
            self._pending = np.concatenate([self._pending, samples])
            new: list[tuple[float, float, float]] = []
            while True:
                n = frame_sample(self._frames + 1, self.fps) - frame_sample(self._frames, self.fps)
                if self._pending.size < n:
                    break
                frame, self._pending = self._pending[:n], self._pending[n:]
                rms = float(np.sqrt(np.mean(np.square(frame, dtype=np.float64))))
                db = 20.0 * math.log10(rms + 1e-5)
                level = min(max((db - LOUDNESS_DB[0]) / (LOUDNESS_DB[1] - LOUDNESS_DB[0]), 0.0), 1.0)
                self._voice += self._voice_alpha * (level - self._voice)
                self._engaged += self._engaged_alpha * (level - self._engaged)
                new.append((self._voice, self._engaged, max(0.0, self._engaged - self._voice)))
                self._frames += 1
            self._rows = (self._rows + new)[-self.keep:] if self.keep else []
        return torch.tensor(new, dtype=torch.float32).reshape(len(new), LISTEN_FEATURES)

    def latest(self, n: int) -> torch.Tensor:
        """The newest n frames' rows (n, LISTEN_FEATURES), oldest first; frames not heard yet count as silence."""
        with self._lock:
            rows = self._rows[-n:] if n else []
        out = torch.zeros(n, LISTEN_FEATURES)
        if rows:
            out[n - len(rows):] = torch.tensor(rows, dtype=torch.float32)
        return out


def listening_features(pcm: np.ndarray | torch.Tensor, fps: int = 24) -> torch.Tensor:
    """16 kHz mono audio -> its listening rows (T, LISTEN_FEATURES), one per whole video frame."""
    if isinstance(pcm, torch.Tensor):
        pcm = pcm.detach().cpu().numpy()
    track = ListeningTrack(fps, keep=0)
    return track.push(np.asarray(pcm))


def silent_rows(n: int) -> torch.Tensor:
    """Rows (n, LISTEN_FEATURES) of a user who says nothing."""
    return torch.zeros(n, LISTEN_FEATURES)

