"""Semantic end of turn: does the user's audio so far sound like a finished turn?

Smart Turn v3.2 (Pipecat's, BSD-2-Clause) reads the last 8 s of the user's 16 kHz audio as Whisper log-mel
features and gives the probability that the turn is complete, from the words and the intonation alike
("My favourite colour is green, and" sounds unfinished; "What is yours?" does not). Its 8.7 MB ONNX file
ships inside the `pipecat-ai` wheel on PyPI (pinned in pyproject.toml); it is read from there, checked by
sha256 and run with onnxruntime. Nothing of Pipecat is imported.

The voice loop asks it once a silence reaches `min_endpointing_delay`: a complete turn ends there, an
incomplete one waits for `max_endpointing_delay` of silence (or for the user to go on).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
from pathlib import Path

import numpy as np

from engine.audio import SAMPLE_RATE

WINDOW_S = 8  # the model reads the last 8 s, zero-padded in front when shorter
N_FFT, HOP, N_MELS = 400, 160, 80

DISTRIBUTION = "pipecat-ai"
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
MODEL_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"


def model_path() -> Path:
    """Smart Turn's ONNX file inside the installed pipecat-ai wheel; ValueError naming what is wrong."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise ValueError(f"the end-of-turn model comes with {DISTRIBUTION}, which is not installed: "
                         "pip install -e . installs it") from err
    path = Path(str(dist.locate_file(MODEL_FILE)))
    if not path.is_file():
        raise ValueError(f"{DISTRIBUTION} {dist.version} has no {MODEL_FILE} (pyproject.toml pins the version that does)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != MODEL_SHA256:
        raise ValueError(f"{path} (from {DISTRIBUTION} {dist.version}) has sha256 {digest}, expected {MODEL_SHA256}")
    return path


@functools.cache
def _mel_filters() -> np.ndarray:
    from faster_whisper.feature_extractor import FeatureExtractor

    return FeatureExtractor.get_mel_filters(SAMPLE_RATE, N_FFT, n_mels=N_MELS).astype(np.float64)


def log_mel_features(audio: np.ndarray) -> np.ndarray:
    """(80, 800) Whisper log-mel features of the last 8 s of 16 kHz audio, as Smart Turn was trained on:
    left-padded with zeros to 8 s, the waveform normalized to zero mean and unit variance, a centred STFT
    (periodic Hann window of 400, hop 160), Slaney mel bands, log10 clamped to 8 below its maximum."""
    samples = WINDOW_S * SAMPLE_RATE
    x = np.asarray(audio, dtype=np.float32)[-samples:]
    x = np.pad(x, (samples - x.size, 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), (N_FFT // 2, N_FFT // 2), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP]
    window = np.hanning(N_FFT + 1)[:-1]
    power = np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2
    log_spec = np.log10(np.maximum(1e-10, _mel_filters() @ power.T))[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


@functools.cache
def _session(threads: int):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(model_path()), providers=["CPUExecutionProvider"], sess_options=options)


class SmartTurn:
    """Probability that a turn is complete, from the user's audio up to now (16 kHz mono float32)."""

    def __init__(self, threads: int = 1) -> None:
        # One thread by default: speech recognition decodes at the same pause and needs the other cores.
        self.threads = threads
        self._session = _session(self.threads)

    def complete_probability(self, audio: np.ndarray) -> float:
        features = log_mel_features(audio)[None]
        (probability,) = self._session.run(None, {"input_features": features})
        return float(np.asarray(probability).reshape(-1)[0])


# Words after which no sentence ends, and openings that need a main clause after them.
_CONTINUING = frozenset("""and but so or nor because the a an to of with for in on at from my your our their his her its
that which who whose than if when then like as about into""".split())
_OPENING_CLAUSE_WORDS = 7
_OPENS_A_CONDITION = re.compile(r"^(if|when|whenever|although|though|unless|once|while|as soon as)\b", re.I)


def unfinished_words(text: str) -> bool:
    """Whether the words heard so far cannot be a whole turn: they end on a comma or a word that no sentence
    ends on ("and", "the", "to"), or are one short clause opened by "if", "when", "unless"... with nothing
    after it ("When you have a moment."). A question mark always ends a turn. Speech recognition adds a full stop to
    speech cut off mid-sentence, so the words, not the stop, decide; Smart Turn, which hears the voice fall
    at a comma as at a full stop, is held back by this check."""
    text = text.strip()
    if not text or text.endswith("?"):
        return False
    if text.endswith((",", ";", ":", "-", "...", "…")):
        return True
    words = re.findall(r"[a-z']+", text.lower())
    if words and words[-1] in _CONTINUING:
        return True
    # an opening clause is short; a longer run of words without a comma has its main clause too (speech
    # recognition does not always write the comma)
    return bool(_OPENS_A_CONDITION.match(text)) and "," not in text and len(words) <= _OPENING_CLAUSE_WORDS


# Openings of a clause that asks the character something: a question word, an inverted verb, or a request.
_ASKS = re.compile(r"^(what|where|when|who|whom|whose|why|how|which|do|does|did|is|are|was|were|am|can|could|would|"
                   r"will|shall|should|may|might|have|has|had|isn't|aren't|don't|doesn't|didn't|won't|can't|wouldn't|"
                   r"couldn't|shouldn't|tell|give|show|explain|describe|say|sing|help|name|recommend|suggest|teach|"
                   r"remind|read|spell|count|let's|please)\b", re.I)


# A greeting, perhaps with a name or "there": said before a question as often as alone.
_GREETING = re.compile(r"^(hello|hi|hey|hiya|howdy|greetings|good (morning|afternoon|evening))( there| again)?( \w+)?$")


def only_a_greeting(text: str) -> bool:
    """Whether the words are a greeting and nothing more ("Hello?", "Hi there, Ada."). Speech recognition writes
    a lone "Hello," as "Hello?", and the user often goes on with the question itself."""
    said = " ".join(re.findall(r"[a-z']+", text.lower()))
    match = _GREETING.match(said)
    return bool(match) and not (match.group(4) and _ASKS.match(match.group(4).strip()))


def asks_something(text: str) -> bool:
    """Whether the words end on a question or a request, which the character is to answer at once: a question
    mark, or a last clause opened by a question word, an inverted verb or a request ("what is yours", "tell me
    about the moon"). Speech recognition often leaves the question mark off a short question. Words that cannot
    end a turn (`unfinished_words`) ask nothing yet, nor does a greeting alone: it waits as a statement does, in
    case the question follows."""
    text = text.strip()
    if not text or unfinished_words(text) or only_a_greeting(text):
        return False
    if text.endswith("?"):
        return True
    last = re.split(r"[,.;:!?]+", text.rstrip(".!;: "))[-1].strip()
    return bool(_ASKS.match(last))

