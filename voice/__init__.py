"""Voice agent loop: VAD -> speech recognition -> reply agent (a local language model) -> text to speech, with
barge-in and per-turn latency traces. Offline: every model comes from a PyPI package."""

from .agent import OpenAIChatAgent, ReplyAgent
from .asr import WhisperASR
from .llm import LocalLLM, LocalLLMAgent
from .loop import AudioSink, LoopEvent, RecordingSink, VoiceLoop, VoiceLoopConfig, feed_audio
from .trace import SessionTrace, TurnTrace
from .tts import PiperTTS
from .vad import StreamingVAD, VADConfig

__all__ = [
    "AudioSink",
    "LoopEvent",
    "OpenAIChatAgent",
    "LocalLLM",
    "LocalLLMAgent",
    "PiperTTS",
    "RecordingSink",
    "ReplyAgent",
    "SessionTrace",
    "StreamingVAD",
    "TurnTrace",
    "VADConfig",
    "VoiceLoop",
    "VoiceLoopConfig",
    "WhisperASR",
    "feed_audio",
]
