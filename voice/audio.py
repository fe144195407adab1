"""The voice agent's audio names, kept for voice/loop.py: they live in `engine.audio`, import them from there."""

from engine.audio import SAMPLE_RATE, StreamResampler, resample, to_mono_float32

__all__ = ["SAMPLE_RATE", "StreamResampler", "resample", "to_mono_float32"]
