"""One offline voice turn from a WAV file, or from a question spoken for you.

    python -m voice --wav question.wav --json
    python -m voice --say "What is the capital of France?" --json

The WAV goes through the same VoiceLoop as live audio, in 32 ms chunks at
wall-clock pace (--fast feeds it as quickly as possible; then the silence wait
and speech recognition no longer overlap the way they do live). Prints the
transcript, the reply, the path of the reply audio and the stage timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from engine.audio import SAMPLE_RATE, load_wav_16k, write_wav

from .loop import RecordingSink, feed_audio
from .options import EXIT_INTERRUPTED, add_loop_args, build_loop, report_failure
from .samples import sample_speech, with_silence


class NoSpeechError(ValueError):
    pass


def run_wav_turn(args: argparse.Namespace) -> dict[str, Any]:
    if args.say is not None:
        if not args.say.strip():
            raise ValueError("--say needs words to say")
        # espeak-ng when installed (a voice unlike the reply's), else the Piper voice
        audio = with_silence(sample_speech(args.say), before_s=0.3, after_s=0.0)
    else:
        audio = load_wav_16k(args.wav)
    source = "spoken: " + args.say if args.say is not None else str(args.wav)
    if float(np.max(np.abs(audio))) == 0.0:
        raise NoSpeechError(f"{source} is all silence (every sample is zero)")
    sink = RecordingSink()
    loop = build_loop(args, sink)
    try:
        real_time = not args.fast
        clock = feed_audio(loop, audio, real_time=real_time)
        # A recording may stop mid-word: trail it with silence so the turn can end.
        tail = np.zeros(int((loop.vad.config.min_silence_ms + loop.vad.config.speech_pad_ms + 200) * SAMPLE_RATE / 1000), np.float32)
        feed_audio(loop, tail, real_time=real_time, clock=clock)
        if not loop.wait_idle(timeout=args.timeout):
            raise RuntimeError(f"no reply within {args.timeout:.0f} s")
        if not loop.trace.turns:
            raise NoSpeechError(f"no speech detected in {source}")
        answered = [t for t in loop.trace.turns if t.info.get("user_text")]
        if not answered:
            raise NoSpeechError(f"speech-like sound in {source} but no words were recognised")
        turn = answered[-1]
        if turn.info.get("status") == "error":
            raise RuntimeError(turn.info.get("error", "the reply failed"))
        first_audio = turn.stamps.get("tts_first_audio")
        reply_audio = sink.audio(since=first_audio) if first_audio is not None else np.zeros(0, np.float32)
        out = reply_path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="talkloop-voice-")) / "reply.wav"
        write_wav(out, reply_audio, args.sample_rate)
        return {
            "input": source,
            "input_seconds": round(audio.shape[0] / SAMPLE_RATE, 3),
            "feed": "real_time_32ms_chunks" if real_time else "fast_32ms_chunks",
            "transcript": turn.info.get("user_text", ""),
            "reply": turn.info.get("reply_text", ""),
            "reply_audio": str(out),
            "reply_audio_seconds": round(reply_audio.shape[0] / args.sample_rate, 3),
            "sample_rate": args.sample_rate,
            "status": turn.info.get("status"),
            "turns": len(loop.trace.turns),
            "timings_s": turn.durations(),
        }
    finally:
        loop.close()


def reply_path(out: str) -> Path:
    """--out: an existing folder (the reply goes in it as reply.wav) or a .wav file in an existing folder."""
    path = Path(out)
    if path.is_dir():
        return path / "reply.wav"
    if path.suffix.lower() != ".wav":
        raise ValueError(f"--out {out}: give a .wav file or an existing folder (the reply is written as WAV)")
    if not path.resolve().parent.is_dir():
        raise ValueError(f"--out {out}: folder {path.resolve().parent} does not exist")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m voice", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    question = parser.add_mutually_exclusive_group(required=True)
    question.add_argument("--wav", help="the question, a WAV file (any rate, mono or stereo)")
    question.add_argument("--say", help="the question as text, spoken for you (espeak-ng if installed, else the Piper voice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", default=None, help="reply WAV path, or a directory for reply.wav (default: a temp dir)")
    parser.add_argument("--fast", action="store_true", help="feed faster than real time")
    parser.add_argument("--timeout", type=float, default=60.0, help="give up waiting for the reply after this many seconds")
    add_loop_args(parser)
    args = parser.parse_args(argv)
    try:
        if args.out:
            reply_path(args.out)  # before the models load
        result = run_wav_turn(args)
    except KeyboardInterrupt:
        return report_failure("interrupted", args.json, EXIT_INTERRUPTED)
    except (ValueError, OSError, RuntimeError) as err:
        return report_failure(f"{type(err).__name__}: {err}", args.json)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"you said:   {result['transcript']}")
        print(f"reply:      {result['reply']}")
        print(f"reply audio: {result['reply_audio']} ({result['reply_audio_seconds']} s)")
        for name, value in result["timings_s"].items():
            print(f"  {name:28s} {value * 1000:7.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
