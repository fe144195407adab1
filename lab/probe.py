"""What ffprobe sees in a recorded session: each stream's codec and duration."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path


def probe_streams(path: str | Path) -> dict[str, dict]:
    """{'video': {...}, 'audio': {...}}: codec, ffprobe's duration, and the duration of the decoded
    content (video frames x frame time; audio samples / rate), seconds."""
    ffprobe = shutil.which("ffprobe")
    if ffprobe is None:
        raise RuntimeError("ffprobe not found (Debian: apt-get install ffmpeg)")
    out = subprocess.run([ffprobe, "-v", "error", "-count_frames", "-show_entries",
                          "stream=codec_type,codec_name,duration,nb_read_frames,avg_frame_rate,sample_rate",
                          "-of", "json", str(path)], check=True, capture_output=True, text=True, timeout=120)
    streams = {}
    for s in json.loads(out.stdout)["streams"]:
        kind = s["codec_type"]
        info = {"codec": s["codec_name"], "duration": float(s["duration"]) if s.get("duration") not in (None, "N/A") else None}
        if kind == "video":
            num, den = (int(x) for x in s["avg_frame_rate"].split("/"))
            info["decoded_duration"] = int(s["nb_read_frames"]) * den / num
        streams[kind] = info
    if "audio" in streams:
        streams["audio"]["decoded_duration"] = _audio_seconds(path)
    return streams


def _audio_seconds(path: str | Path) -> float:
    import av

    samples, rate = 0, None
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    return samples / rate if rate else 0.0
