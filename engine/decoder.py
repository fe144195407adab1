"""Kept only for tests/test_faults.py, which imports StandInCodec from here: the codec seam lives in `engine.codec`."""

from engine.codec import StandInCodec

__all__ = ["StandInCodec"]
