"""The workstation's own microphone (`--audio-input local`), through sounddevice."""

from __future__ import annotations

from typing import Callable

import numpy as np

RATE = 16000
BLOCK = 512  # 32 ms, the VAD's window


class LocalMicrophone:
    """Feeds 16 kHz mono blocks to `feed` from sounddevice's callback thread.

    RuntimeError with a readable reason when there is no PortAudio library or no input device.
    """

    def __init__(self, feed: Callable[[np.ndarray, int], None], device: int | str | None = None):
        try:
            import sounddevice as sd
        except (ImportError, OSError) as e:  # OSError: the PortAudio library itself is missing
            raise RuntimeError(f"local microphone unavailable: sounddevice cannot load PortAudio ({e}); "
                               "install libportaudio2 or use the browser's microphone") from None
        try:
            info = sd.query_devices(device, kind="input")
        except (ValueError, sd.PortAudioError) as e:
            raise RuntimeError(f"local microphone unavailable: no input sound device on this machine ({e}); "
                               "use the browser's microphone (--audio-input browser)") from None

        def callback(indata, frames, time_info, status) -> None:
            feed(np.ascontiguousarray(indata[:, 0], dtype=np.float32), RATE)

        try:
            self.stream = sd.InputStream(device=device, channels=1, samplerate=RATE, blocksize=BLOCK, dtype="float32",
                                         callback=callback)
            self.stream.start()
        except sd.PortAudioError as e:
            raise RuntimeError(f"local microphone {info.get('name', device)!r} could not be opened: {e}") from None

    def close(self) -> None:
        self.stream.stop()
        self.stream.close()
