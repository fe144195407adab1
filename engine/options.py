"""Engine options: every setting an engine is built with, under one name each.

`EngineOptions` is what the app's settings, generate's flags and the lab's `--config` all
become; `engine/build.py` turns it into a running character. Named presets sit beside it:

    options = parse_options("fp8-cache,reset_every=0")     # PRESET[,key=value...]
    options = parse_options("my-config.json")               # {"preset": "tp2", "kv_dtype": "fp8"}

`check_options` refuses settings that cannot run, here or at all, with an error naming the
key and value; `apply_gemm_mode_` puts a model's block linears in the options' GEMM mode, and
`new_session` makes the engine session the options describe, in this process or in one of the
engine's own rank processes.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from engine.cache import KV_DTYPES
from engine.config import shard_spec
from engine.kernels import ATTENTION_KERNELS, GEMM_MODES
from engine.model import CausalVideoDiT
from engine.session import BACKENDS, CACHES, EngineSession
from engine.weights import pick_device

# attention_p: how the ws kernel writes P: auto as the ring serves it, or the P settings (exp2, row_sum) of one of the
# kernel's named option sets, over the ring's served ones (engine/kernels/fp8_attention_ws.py)
ATTENTION_P = ("auto", "nearest", "log-linear")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # auto: bfloat16 on CUDA, float32 on the CPU
GROUP_BLEND = 0.5  # how far each step's first frame goes toward the frame before it, unless a config says otherwise


@dataclass(frozen=True)
class EngineOptions:
    """One engine's settings. The defaults are the engine's own (the session's automatic backend);
    the presets below name the configurations the lab compares."""

    name: str = "default"  # the label results carry: the preset text or JSON file the options came from
    spec: str = "demo"  # model spec (engine.config.SPECS); callers with a spec object of their own pass that
    weights: str | None = None  # checkpoint (None: the one shipped for the spec, else random weights)
    seed: int = 0  # random weights' seed, and the sampling noise's unless noise_seed is given
    noise_seed: int | None = None  # sampling noise (None: seed)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cache: str = "ring"  # ring | reference
    kv_dtype: str = "fp8"  # ring cache storage (the reference cache keeps float K/V)
    backend: str = "auto"  # auto (triton where it runs) | torch (SDPA over the ring) | triton (FP8 attention kernels)
    attention: str = "auto"  # with backend triton: auto | triton | ws (the warp-specialised Hopper kernel)
    # with attention ws: how P is written: as the ring serves it (auto: log-linear), or named: nearest (the e4m3 value
    # nearest 2^x, row sums in FP32) or log-linear (2^x written as codes by one FMA each, row sums on the tensor cores)
    attention_p: str = "auto"
    gemm: str = "plain"  # plain | fp8 (block linears in FP8) | fp8-fast (and the tensor cores' fast accumulation)
    cuda_graph: bool = False  # replay each step's passes as one CUDA graph (triton backend, one diffusion process)
    reset_every: int | None = None  # steps between position resets (None: the spec's; 0: never)
    tp: int = 1  # tensor-parallel degree: processes (gloo on CPU, GPUs 0..tp-1 on CUDA)
    fused_allreduce: bool = False  # MLP-out GEMM with its all-reduce overlapped (tp >= 2)
    processes: bool = False  # diffusion and decoding in the engine's own processes (always so at tp >= 2)
    gpus: str | None = None  # the engine's processes on these GPUs, e.g. 0,1,2,3 ("all": every visible one)
    decoder_gpu: str | None = None  # GPU(s) that only decode, e.g. 3 (None: the placement's default)
    prebuffer: int = 4  # playout buffer: frames waiting before playback (re)starts
    max_lead: int = 7  # playout buffer: the most frames the engine may run ahead
    adaptive_lead: bool = False  # keep only the playout lead the engine's recent steps need (engine/playout.py)
    hold_when_late: bool = False  # below real time, hold the picture and keep the sound on the clock (engine/realtime.py)
    # CPU threads for an engine in this process on the CPU (None: torch's default, every core). Fewer than the cores
    # when other work shares them: an op split over threads waits for the slowest, so one busy core stalls them all
    threads: int | None = None
    # the model's and codec's numbers: auto (bfloat16 on CUDA, float32 on the CPU), float32, or bfloat16 (on a CPU with
    # bf16 matrix instructions, AVX512-BF16 or AMX: cpu_has_bf16; its speed: docs/app.md, "Sharing the CPU")
    dtype: str = "auto"
    # each step's first frame this much the frame made before it (engine/realtime.py, blend_group_start; 0: off)
    group_blend: float = GROUP_BLEND

    @property
    def own_processes(self) -> bool:
        """Whether the engine runs in processes of its own (DistributedEngine) rather than in this one."""
        return self.processes or self.tp > 1 or self.gpus is not None

    @property
    def session_seed(self) -> int:
        return self.seed if self.noise_seed is None else self.noise_seed

    def attention_options(self) -> dict:
        """The ring cache's attention options: the kernel, and the ws kernel's P settings when named."""
        return {"kernel": self.attention, **attention_p_options(self.attention_p)}

    def describe(self) -> str:
        kv = self.kv_dtype if self.cache == "ring" else "float"
        extra = [f"tp={self.tp}"] if self.tp > 1 else (["processes"] if self.processes else [])
        extra += [f"gpus={self.gpus}"] if self.gpus is not None else []
        extra += ["fused_allreduce"] if self.fused_allreduce else []
        extra += [f"decoder_gpu={self.decoder_gpu}"] if self.decoder_gpu is not None else []
        extra += [f"attention={self.attention}"] if self.backend == "triton" else []
        extra += [f"attention_p={self.attention_p}"] if self.attention_p != "auto" else []
        extra += ["cuda_graph"] if self.cuda_graph else []
        extra += [f"reset_every={self.reset_every}"] if self.reset_every is not None else []
        extra += ["adaptive_lead"] if self.adaptive_lead else []
        extra += ["hold_when_late"] if self.hold_when_late else []
        extra += [f"threads={self.threads}"] if self.threads is not None else []
        extra += [f"dtype={self.dtype}"] if self.dtype != "auto" else []
        extra += [f"group_blend={self.group_blend:g}"] if self.group_blend != GROUP_BLEND else []
        return " ".join([f"{self.name}: cache={self.cache} kv={kv} backend={self.backend} gemm={self.gemm}", *extra])


CONFIG_PRESETS: dict[str, dict] = {
    "reference": dict(cache="reference", kv_dtype="fp32", backend="torch"),  # the plain path: float cache, RoPE at read time
    "ring-fp32": dict(cache="ring", kv_dtype="fp32", backend="torch"),  # ring cache, RoPE at write time, position resets
    "fp8-cache": dict(cache="ring", kv_dtype="fp8", backend="torch"),  # + FP8 K/V with static per-head scales
    "fp8-attention": dict(cache="ring", kv_dtype="fp8", backend="triton"),  # + the Triton FP8 attention kernels
    "fp8-gemm": dict(cache="reference", kv_dtype="fp32", backend="torch", gemm="fp8"),  # the plain path, FP8 linears
    "fp8-gemm-fast": dict(cache="reference", kv_dtype="fp32", backend="torch", gemm="fp8-fast", device="cuda"),
    "tp2": dict(cache="reference", kv_dtype="fp32", backend="torch", tp=2),
    "tp3": dict(cache="reference", kv_dtype="fp32", backend="torch", tp=3),
    "fused-allreduce": dict(cache="reference", kv_dtype="fp32", backend="torch", tp=2, fused_allreduce=True),
    "cuda-graph": dict(cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True, device="cuda"),
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_WARNED: set[str] = set()  # options already warned about, once per process


def attention_p_options(attention_p: str) -> dict:
    """The ws kernel's options that make P as `attention_p` names it."""
    if attention_p == "auto":
        return {}
    from engine.kernels.fp8_attention_ws import NEAREST_P_OPTIONS, SERVED_OPTIONS  # Triton only when P is named

    named = {"nearest": NEAREST_P_OPTIONS, "log-linear": SERVED_OPTIONS}[attention_p]
    return {key: named[key] for key in ("exp2", "row_sum")}


def option_value(key: str, value) -> object:
    """A setting from text (key=value) or JSON, checked against its field's type."""
    kinds = {f.name: f.type for f in fields(EngineOptions)}
    if key not in kinds or key == "name":
        known = ", ".join(k for k in kinds if k != "name")
        raise ValueError(f"unknown config key {key!r}; known keys: {known}")
    kind = kinds[key]
    if "bool" in kind:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _TRUE + _FALSE:
            return str(value).lower() in _TRUE
        raise ValueError(f"config key {key} must be true or false, got {value!r}")
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        if "None" in kind:
            return None
        raise ValueError(f"config key {key} needs a value")
    if kind == "float":
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"config key {key} must be a number, got {value!r}") from None
    if "int" in kind:
        if isinstance(value, bool) or not (isinstance(value, int) or str(value).lstrip("-").isdigit()):
            raise ValueError(f"config key {key} must be a whole number, got {value!r}")
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # a GPU index from JSON, e.g. "decoder_gpu": 3
    if not isinstance(value, str):
        raise ValueError(f"config key {key} must be text, got {value!r}")
    return value


def parse_options(text: str) -> EngineOptions:
    """`PRESET[,key=value...]` (e.g. `fp8-cache,reset_every=0`) or a JSON file {"preset": ..., key: value}."""
    text = text.strip()
    if text.endswith(".json") or Path(text).is_file():
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        try:
            blob = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {path} is not valid JSON: {e}") from None
        if not isinstance(blob, dict):
            raise ValueError(f"config file {path} must hold a JSON object, got {type(blob).__name__}")
        blob = dict(blob)
        preset = blob.pop("preset", None)
        if not isinstance(preset, str):
            raise ValueError(f"config file {path} needs \"preset\": one of {', '.join(CONFIG_PRESETS)}")
        overrides = list(blob.items())
        name = path.name
    else:
        preset, *pairs = [p.strip() for p in text.split(",")]
        overrides = []
        for pair in pairs:
            if "=" not in pair:
                raise ValueError(f"config override {pair!r} is not key=value (in {text!r})")
            key, value = (x.strip() for x in pair.split("=", 1))
            overrides.append((key, value))
        name = text
    if preset not in CONFIG_PRESETS:
        raise ValueError(f"unknown config preset {preset!r}; known presets: {', '.join(CONFIG_PRESETS)}")
    settings = dict(CONFIG_PRESETS[preset])
    for key, value in overrides:
        settings[key] = option_value(key, value)
    options = EngineOptions(name=name, **settings)
    check_options(options)
    return options


def gpu_list(text: str | None, key: str) -> list[int]:
    """`0,1,2` -> [0, 1, 2]; an error naming the key for anything else."""
    if text is None or text.strip() == "":
        return []
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{key} must be comma-separated GPU indices, got {text!r}") from None


def check_options(options: EngineOptions, spec=None) -> None:
    """Clear errors for settings that cannot run (here, or at all); a warning for slow ones."""
    c = options
    for key, value, choices in (("cache", c.cache, CACHES), ("kv_dtype", c.kv_dtype, tuple(KV_DTYPES)),
                                ("backend", c.backend, BACKENDS), ("gemm", c.gemm, GEMM_MODES),
                                ("attention", c.attention, ATTENTION_KERNELS), ("attention_p", c.attention_p, ATTENTION_P),
                                ("dtype", c.dtype, tuple(DTYPES))):
        if value not in choices:
            raise ValueError(f"config {c.name}: {key} must be one of {', '.join(choices)}, got {value!r}")
    if not (c.device in ("auto", "cpu", "cuda") or (c.device.startswith("cuda:") and c.device[5:].isdigit())):
        raise ValueError(f"config {c.name}: device must be auto, cpu, cuda or cuda:N, got {c.device!r}")
    if not 0.0 <= c.group_blend < 1.0:
        raise ValueError(f"config {c.name}: group_blend must be in [0, 1), got {c.group_blend}")
    if c.threads is not None and c.threads < 1:
        raise ValueError(f"config {c.name}: threads must be >= 1, got {c.threads}")
    gpu = torch.cuda.is_available()
    on_cuda = c.device.startswith("cuda") or (c.device == "auto" and gpu)
    if c.cuda_graph and not gpu:
        raise ValueError(f"config {c.name}: cuda_graph needs a CUDA GPU; none is visible (a GPU-only fast path)")
    if c.gemm == "fp8-fast" and not on_cuda:
        raise ValueError(f"config {c.name}: gemm=fp8-fast needs a CUDA GPU (fast accumulation is a tensor-core mode)")
    if c.device.startswith("cuda") and not gpu:
        raise ValueError(f"config {c.name}: device {c.device} asked for, but no CUDA GPU is visible")
    if c.own_processes and c.gpus is None and c.device.startswith("cuda:") and int(c.device[5:]) != 0:
        raise ValueError(f"config {c.name}: the engine's own processes take GPUs 0..{max(c.tp, 1) - 1}, not {c.device} "
                         "(pick the GPUs with CUDA_VISIBLE_DEVICES, or give gpus)")
    if c.gpus is not None and not on_cuda:
        raise ValueError(f"config {c.name}: gpus={c.gpus} needs device cuda (or auto with a GPU visible)")
    if c.gpus not in (None, "all"):
        gpu_list(c.gpus, "gpus")
    if c.decoder_gpu is not None:
        if not c.own_processes or not on_cuda:
            raise ValueError(f"config {c.name}: decoder_gpu needs the engine's own processes on CUDA "
                             "(processes=true, tp >= 2 or gpus)")
        if c.gpus is None:  # diffusion on GPUs 0..tp-1 (with gpus, the placement checks its own list)
            for i in gpu_list(c.decoder_gpu, "decoder_gpu"):
                if not 0 <= i < torch.cuda.device_count():
                    raise ValueError(f"config {c.name}: decoder_gpu {i} is not visible ({torch.cuda.device_count()} GPU(s))")
                if i < c.tp:
                    raise ValueError(f"config {c.name}: decoder_gpu {i} is a diffusion GPU (0..{c.tp - 1})")
    if c.cache == "reference" and c.backend == "triton":
        raise ValueError(f"config {c.name}: the triton backend needs cache=ring")
    if c.cuda_graph and (c.backend == "torch" or c.cache != "ring" or not on_cuda):
        raise ValueError(f"config {c.name}: cuda_graph needs backend=triton on a CUDA device")
    if c.attention != "auto" and c.backend == "torch":
        raise ValueError(f"config {c.name}: attention={c.attention} picks a kernel of backend=triton, not of backend={c.backend}")
    if c.attention_p != "auto" and c.attention != "ws":
        raise ValueError(f"config {c.name}: attention_p={c.attention_p} is an option of the ws kernel: add attention=ws")
    if c.attention == "ws" and not on_cuda:
        raise ValueError(f"config {c.name}: attention=ws (the warp-specialised Hopper kernel) needs a CUDA GPU")
    if c.backend == "triton" and not on_cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"config {c.name}: backend=triton on the CPU runs only under Triton's interpreter "
                             "(set TRITON_INTERPRET=1; slow)")
        if c.name not in _WARNED:
            _WARNED.add(c.name)
            print(f"warning: config {c.name}: Triton kernels under the interpreter on the CPU: correct but very slow",
                  file=sys.stderr)
    if c.tp < 1:
        raise ValueError(f"config {c.name}: tp must be >= 1, got {c.tp}")
    if c.fused_allreduce and c.tp < 2:
        raise ValueError(f"config {c.name}: fused_allreduce needs tp >= 2")
    if c.tp > 1 and on_cuda and c.gpus is None and torch.cuda.device_count() < c.tp:
        raise ValueError(f"config {c.name}: tp={c.tp} needs {c.tp} GPUs, {torch.cuda.device_count()} visible")
    if c.reset_every is not None and c.reset_every < 0:
        raise ValueError(f"config {c.name}: reset_every must be >= 0 (0: never), got {c.reset_every}")
    if not 1 <= c.prebuffer <= c.max_lead:
        raise ValueError(f"config {c.name}: need 1 <= prebuffer <= max_lead, got {c.prebuffer}, {c.max_lead}")
    if spec is not None and c.tp > 1:
        try:
            shard_spec(spec, c.tp)
        except ValueError as e:
            raise ValueError(f"config {c.name}: {e}") from None


def options_device(options: EngineOptions) -> torch.device:
    """The device the options name, resolved (auto: a GPU when one is visible)."""
    return pick_device(options.device)


def model_dtype(options: EngineOptions, device: torch.device) -> torch.dtype:
    """The DiT's dtype on `device` under the options (auto: bfloat16 on CUDA, float32 on the CPU)."""
    return DTYPES[options.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def codec_dtype(options: EngineOptions) -> torch.dtype:
    """The codec's dtype: float32 unless the options ask for bfloat16."""
    return DTYPES[options.dtype] or torch.float32


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX), where they beat float32;
    elsewhere they are emulated, and slower."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def apply_gemm_mode_(model: CausalVideoDiT, mode: str, *, fuse: bool, branch_streams: bool = True) -> CausalVideoDiT:
    """The model's block linears under `mode` (one of GEMM_MODES), in place: FP8 modes swap in FP8 linears and,
    with `fuse`, fused FP8 blocks (engine/fused_block.py's apply_fp8_kernels)."""
    if mode not in GEMM_MODES:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_MODES)}, got {mode!r}")
    if mode != "plain":
        from engine.fused_block import apply_fp8_kernels  # Triton, an optional dependency: FP8 modes only

        apply_fp8_kernels(model, fuse=fuse, branch_streams=branch_streams, fast_accum=mode == "fp8-fast")
    return model


def new_session(model: CausalVideoDiT, options: EngineOptions, *, attention: dict | None = None) -> EngineSession:
    """The engine session the options describe, on `model` (a whole model, or one rank's shard).
    `attention`: the attention kernel's own tile options over the options' kernel, for benchmarks that sweep them."""
    return EngineSession(model, cache=options.cache, kv_dtype=options.kv_dtype, reset_every=options.reset_every,
                         seed=options.session_seed, backend=options.backend, cuda_graph=options.cuda_graph,
                         attention_options={**options.attention_options(), **(attention or {})})
