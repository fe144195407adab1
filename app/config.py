"""App settings: defaults, then a YAML file (--config), then command-line flags.

Every setting has one name, used as the YAML key and (with dashes) as the flag:
`min_silence_ms: 500` in the file is `--min-silence-ms 500` on the command line, and a
true/false setting also has its `--no-` flag (`--no-record`). A YAML key the app does not
know, an empty value, or a value of the wrong type, is an error that names it, so a typo
never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.character import PRESETS
from engine.config import SPECS


def default_recordings_dir() -> str:
    return str(Path.home() / ".cache" / "talkloop" / "recordings")


def setting(default: Any, help: str) -> Any:
    """A field with the line its flag shows in --help."""
    return field(default=default, metadata={"help": help})


@dataclass
class AppConfig:
    host: str = setting("127.0.0.1", "address to serve on")
    port: int = setting(7860, "port to serve on")
    # Engine: the names of engine.options.EngineOptions, which app/engine_host.py maps them onto
    device: str = setting("auto", "engine and voice models device")
    spec: str = setting("auto", "engine model spec; auto: the largest shipped one that keeps real time here, measured at start")
    weights: str | None = setting(None, "engine checkpoint (default: the one shipped for the spec)")
    gpus: str | None = setting(None, "placement: diffusion GPUs, one process each, e.g. 0,1,2")
    decoder_gpu: str | None = setting(None, "placement: GPU(s) that only decode, e.g. 3")
    tp: int | None = setting(None, "placement without GPUs: tensor-parallel degree in CPU processes")
    engine_threads: int | None = setting(None, "engine in this process on the CPU: its threads (default: half the "
                                               "cores, at least 1; the voice models and the browser use the rest)")
    engine_dtype: str = setting("auto", "the engine's numbers: auto (bfloat16 on a GPU, and on a CPU with bf16 matrix "
                                        "instructions, AVX512-BF16 or AMX; else float32), float32 or bfloat16")
    max_lead: int = setting(7, "playout buffer: the most frames the engine may run ahead")
    adaptive_lead: bool = setting(True, "keep only the lead the engine's recent steps need (engine/playout.py)")
    hold_when_late: bool = setting(True, "when the engine falls below real time, the voice keeps the clock and the "
                                         "picture holds between the frames it makes (engine/realtime.py)")
    cuda_graph: bool = setting(True, "replay the engine's step as a CUDA graph on a GPU (one diffusion process; needs Triton)")
    prebuffer: int = setting(4, "playout buffer: frames waiting before playback (re)starts")
    preset: str = setting("ada", "character preset at start")
    session_log: str | None = setting(None, "per-session fps log (default: engine.session_log.default_log())")
    transport: str = setting("webrtc", "video to the browser: webrtc, or hls (Gradio's streaming video; "
                                       "a fallback, seconds behind)")
    # Voice
    audio_input: str = setting("browser", "microphone: the browser's, or local (this machine's own)")
    # The browser's own processing of its microphone (getUserMedia constraints; docs/app.md, "The browser's microphone")
    mic_echo_cancellation: bool = setting(True, "browser microphone: echo cancellation (keeps the character's voice "
                                                "from the speakers out of it)")
    mic_auto_gain: bool = setting(False, "browser microphone: automatic gain control (on, it cut first and last words)")
    mic_noise_suppression: bool = setting(False, "browser microphone: noise suppression")
    client_interruption_ms: int = setting(80, "browser: the page silences the character's voice once the user has "
                                              "spoken over it this long, before the server's barge-in reaches it "
                                              "(0: off; docs/app.md, \"Barge-in and Stop\")")
    agent: str = setting("local", "replies: local (a small language model in this process) or openai "
                                  "(an OpenAI-compatible endpoint you run, for bigger models)")
    llm: str = setting("auto", "agent local: the language model: auto (qwen2.5-1.5b; on a machine of 2 cores or fewer "
                               "whose model runs on the CPU, the lighter qwen2.5-0.5b when installed), qwen2.5-1.5b or "
                               "qwen2.5-0.5b")
    llm_device: str = setting("auto", "agent local: where the language model runs: auto (the GPU when the engine "
                                      "runs on one and llama.cpp was built for CUDA, else the CPU), cpu or cuda")
    llm_threads: int | None = setting(None, "agent local: CPU threads for the language model (default: all cores "
                                            "up to 4, else up to 8)")
    name: str | None = setting(None, "the character's name (default: the preset's own, voice/personas.py)")
    base_url: str = setting("http://127.0.0.1:8080/v1", "agent openai: the endpoint")
    model: str = setting("local", "agent openai: the model name")
    system_prompt: str | None = setting(None, "the system prompt ({name} and {personality} become the persona's)")
    asr_model: str | None = setting(None, "speech recognition model folder (default: the shipped Whisper model)")
    voice: str | None = setting(None, "Piper voice model for the character's speech (default: the shipped one)")
    vad_threshold: float = setting(0.5, "speech probability the VAD takes as speech, between 0 and 1")
    turn_detection: str = setting("smart_turn", "end of turn: smart_turn (a model judges each pause) or silence "
                                                "(min_silence_ms of silence alone)")
    min_endpointing_delay: float = setting(0.2, "smart_turn: silence after which the model judges the turn, in "
                                                "seconds; a complete one ends then")
    max_endpointing_delay: float = setting(1.6, "smart_turn: silence that ends a turn the model finds incomplete, "
                                                "in seconds")
    statement_endpointing_delay: float = setting(0.8, "smart_turn: silence that ends a complete turn whose words are "
                                                      "not a question, in seconds")
    check_words: bool = setting(True, "smart_turn: a turn the model finds complete waits while its words so far "
                                      "cannot end it (a trailing 'and', a lone 'If ...' clause)")
    preemptive_generation: bool = setting(True, "start the reply at the user's pause, heard only once the turn "
                                                "has ended with the same words")
    min_silence_ms: int = setting(300, "turn_detection silence: silence that ends the user's turn, in ms")
    preroll_ms: int = setting(200, "audio kept before the detected start of speech, so the first word is whole")
    # Recording
    record: bool = setting(False, "record every session (MP4 + trace + transcript)")
    recordings_dir: str = field(default_factory=default_recordings_dir, metadata={"help": "where recorded sessions go"})

    def validate(self) -> "AppConfig":
        for f in fields(self):  # checked first: the checks below compare values
            if getattr(self, f.name) is None and f.name not in OPTIONAL:
                raise ValueError(f"config key {f.name!r} needs a value")
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be {_one_of(allowed)}, got {getattr(self, key)!r}")
        checks = [
            (self.spec in SPECS or self.spec == "auto", f"unknown spec {self.spec!r}; known: auto, {', '.join(SPECS)}"),
            (self.preset in PRESETS, f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}"),
            (1 <= self.port <= 65535, f"port must be 1..65535, got {self.port}"),
            (1 <= self.prebuffer <= self.max_lead, f"need 1 <= prebuffer <= max_lead, got {self.prebuffer}, {self.max_lead}"),
            (self.tp is None or self.tp >= 1, f"tp must be >= 1, got {self.tp}"),
            (self.llm_threads is None or self.llm_threads >= 1, f"llm_threads must be >= 1, got {self.llm_threads}"),
            (self.engine_threads is None or self.engine_threads >= 1,
             f"engine_threads must be >= 1, got {self.engine_threads}"),
            (0.0 < self.vad_threshold < 1.0, f"vad_threshold must be between 0 and 1, got {self.vad_threshold}"),
            (self.min_silence_ms > 0 and self.preroll_ms >= 0, "min_silence_ms must be > 0 and preroll_ms >= 0"),
            (self.client_interruption_ms >= 0, f"client_interruption_ms must be >= 0, got {self.client_interruption_ms}"),
            (0 < self.min_endpointing_delay < self.max_endpointing_delay,
             "need 0 < min_endpointing_delay < max_endpointing_delay, got "
             f"{self.min_endpointing_delay}, {self.max_endpointing_delay}"),
            (self.min_endpointing_delay <= self.statement_endpointing_delay < self.max_endpointing_delay,
             "need min_endpointing_delay <= statement_endpointing_delay < max_endpointing_delay, got "
             f"{self.min_endpointing_delay}, {self.statement_endpointing_delay}, {self.max_endpointing_delay}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def microphone_constraints(self) -> dict[str, bool]:
        """The browser microphone's processing, as getUserMedia's audio constraints name it."""
        return {"echoCancellation": self.mic_echo_cancellation, "autoGainControl": self.mic_auto_gain,
                "noiseSuppression": self.mic_noise_suppression}


CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "engine_dtype": ("auto", "float32", "bfloat16"),
    "transport": ("webrtc", "hls"),
    "audio_input": ("browser", "local"),
    "agent": ("local", "openai"),
    "llm": ("auto", "qwen2.5-1.5b", "qwen2.5-0.5b"),
    "llm_device": ("auto", "cpu", "cuda"),
    "turn_detection": ("smart_turn", "silence"),
}
# Settings whose default is None ("the app picks"); any other setting needs a value.
OPTIONAL = frozenset(f.name for f in fields(AppConfig) if f.default is None)
# A leading ~ in these is the user's home folder, from a flag (the shell expands it) or the YAML file alike.
PATH_SETTINGS = ("weights", "session_log", "recordings_dir", "asr_model", "voice")


def _one_of(allowed: tuple[str, ...]) -> str:
    return f"{', '.join(allowed[:-1])} or {allowed[-1]}"


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
    if value is None:  # an empty value: validate() names it unless the setting may be None
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
    config = dataclasses.replace(AppConfig(), **values).validate()
    paths = {key: os.path.expanduser(getattr(config, key)) for key in PATH_SETTINGS if getattr(config, key) is not None}
    return dataclasses.replace(config, **paths)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting (--min-silence-ms for min_silence_ms; --record and --no-record for a true/false one).
    A flag not given is None, so the YAML file's value stands (build_config drops None)."""
    defaults = AppConfig()
    for f in fields(AppConfig):
        default = getattr(defaults, f.name)
        help = f.metadata["help"] + ("" if default is None else f" (default {default})")
        help = help.replace("%", "%%")  # argparse formats help with %
        flag = "--" + f.name.replace("_", "-")
        if FIELD_TYPES[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            parser.add_argument(flag, type=FIELD_TYPES[f.name], choices=CHOICES.get(f.name), default=None, help=help)
