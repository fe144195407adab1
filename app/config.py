"""App settings: defaults, then a YAML file (--config), then command-line flags.

Every setting has one name, used as the YAML key and (with dashes) as the flag.
A YAML key the app does not know, or a value of the wrong type, is an error that
names it, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.character import PRESETS
from engine.config import SPECS


def default_recordings_dir() -> str:
    return str(Path.home() / ".cache" / "talkloop" / "recordings")


@dataclass
class AppConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    # Engine
    device: str = "auto"  # auto, cpu, cuda
    spec: str = "demo"
    weights: str | None = None
    gpus: str | None = None  # placement: diffusion GPUs, one process each
    decoder_gpu: str | None = None  # placement: GPU(s) that only decode
    tp: int | None = None  # without GPUs: tensor-parallel degree in CPU processes
    max_lead: int = 7  # playout buffer: frames the engine may run ahead (at most)
    adaptive_lead: bool = True  # keep only the lead the engine's recent steps need (engine/playout.py)
    cuda_graph: bool = True  # replay the engine's step as a CUDA graph on a GPU (one diffusion process; needs Triton)
    prebuffer: int = 4  # playout buffer: frames waiting before playback (re)starts
    preset: str = "ada"
    session_log: str | None = None  # per-session fps log (default: engine.sessions.default_log())
    transport: str = "webrtc"  # webrtc, or hls: Gradio's streaming video, a fallback that adds seconds
    # Voice
    audio_input: str = "browser"  # browser or local (the workstation's own microphone)
    agent: str = "persona"  # persona (offline) or openai (an OpenAI-compatible endpoint)
    name: str = "Ada"
    base_url: str = "http://127.0.0.1:8080/v1"
    model: str = "local"
    system_prompt: str | None = None
    asr_model: str | None = None
    voice: str | None = None
    vad_threshold: float = 0.5
    min_silence_ms: int = 300
    preroll_ms: int = 200  # audio kept before the detected start of speech, so the first word is whole
    # Recording
    record: bool = False
    recordings_dir: str = field(default_factory=default_recordings_dir)

    def validate(self) -> "AppConfig":
        checks = [
            (self.device in ("auto", "cpu", "cuda"), f"device must be auto, cpu or cuda, got {self.device!r}"),
            (self.spec in SPECS, f"unknown spec {self.spec!r}; known: {', '.join(SPECS)}"),
            (self.preset in PRESETS, f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}"),
            (self.audio_input in ("browser", "local"), f"audio_input must be browser or local, got {self.audio_input!r}"),
            (self.transport in ("webrtc", "hls"), f"transport must be webrtc or hls, got {self.transport!r}"),
            (self.agent in ("persona", "openai"), f"agent must be persona or openai, got {self.agent!r}"),
            (1 <= self.port <= 65535, f"port must be 1..65535, got {self.port}"),
            (1 <= self.prebuffer <= self.max_lead, f"need 1 <= prebuffer <= max_lead, got {self.prebuffer}, {self.max_lead}"),
            (self.tp is None or self.tp >= 1, f"tp must be >= 1, got {self.tp}"),
            (0.0 < self.vad_threshold < 1.0, f"vad_threshold must be between 0 and 1, got {self.vad_threshold}"),
            (self.min_silence_ms > 0 and self.preroll_ms >= 0, "min_silence_ms must be > 0 and preroll_ms >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


def _field_types() -> dict[str, type]:
    """The plain type each setting takes (str for `str | None` and so on)."""
    defaults = AppConfig()
    out: dict[str, type] = {}
    for f in fields(AppConfig):
        value = getattr(defaults, f.name)
        if value is not None:
            out[f.name] = type(value)
        else:
            out[f.name] = int if "int" in str(f.type) else str
    return out


FIELD_TYPES = _field_types()


def _coerce(key: str, value: Any) -> Any:
    if value is None:
        return None
    want = FIELD_TYPES[key]
    if want is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key {key!r} must be true or false, got {value!r}")
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. `gpus: 0`
    if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
        raise ValueError(f"config key {key!r} must be {want.__name__}, got {value!r}")
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Settings from a YAML mapping; keys may use dashes or underscores."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in FIELD_TYPES:
            raise ValueError(f"config file {path}: unknown setting {raw_key!r}; known: {', '.join(sorted(FIELD_TYPES))}")
        out[key] = _coerce(key, value)
    return out


def build_config(yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> AppConfig:
    """Defaults < YAML file < overrides (command-line flags that were given)."""
    values: dict[str, Any] = {}
    if yaml_path is not None:
        values.update(load_yaml(yaml_path))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return dataclasses.replace(AppConfig(), **values).validate()
