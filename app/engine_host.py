"""The embedded engine: weights loaded once at start-up, one real-time character per session.

With spec auto (the default) the host first measures each shipped character's step here and serves the
largest that keeps real time with margin (`choose_spec`). One GPU (or the CPU): the engine runs in this process. Several GPUs, or `gpus` / `tp`
given: one process per diffusion GPU plus decoder processes (`DistributedEngine`); a
spare engine is started ahead so the next session does not wait for weights to load.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace

import torch

from app.config import AppConfig
from engine.build import Loaded, build_engine, load, plan_placement, start_processes
from engine.codec import decode_step
from engine.config import ModelSpec, get_spec
from engine.distributed import DistributedEngine
from engine.options import EngineOptions, cpu_has_bf16, new_session
from engine.realtime import RealtimeCharacter
from engine.session import pick_backend
from engine.weights import default_weights, pick_device

log = logging.getLogger(__name__)


def engine_options(config: AppConfig, device: torch.device) -> EngineOptions:
    """The app's engine settings as engine options (same names). On a GPU machine the engine takes the
    visible GPUs in processes of its own once there are several, or a decoder GPU is named; `tp` is for
    CPU processes. FP8 keys and values pay off on GPUs; on the CPU, in this process, with no hardware e4m3
    conversion, they only add a conversion of the whole window at every attention call."""
    c = config
    gpus = c.gpus
    if device.type == "cuda":
        if c.tp is not None:
            raise ValueError("tp is for CPU processes; on GPUs give gpus (and decoder_gpu)")
        if gpus is None and (c.decoder_gpu is not None or torch.cuda.device_count() > 1):
            gpus = "all"
    elif c.gpus or c.decoder_gpu:
        raise ValueError("gpus / decoder_gpu need device cuda")
    own = gpus is not None or c.tp is not None
    threads = None if device.type == "cuda" or own else c.engine_threads or default_engine_threads()
    dtype = c.engine_dtype
    if dtype == "auto" and device.type == "cpu" and cpu_has_bf16():
        dtype = "bfloat16"
    return EngineOptions(name="app", spec=c.spec, weights=c.weights, device=c.device, gpus=gpus,
                         decoder_gpu=c.decoder_gpu, tp=c.tp or 1, processes=c.tp is not None,
                         kv_dtype="fp8" if device.type == "cuda" else "fp32", cuda_graph=c.cuda_graph,
                         prebuffer=c.prebuffer, max_lead=c.max_lead, adaptive_lead=c.adaptive_lead,
                         hold_when_late=c.hold_when_late, threads=threads, dtype=dtype)


def default_engine_threads() -> int:
    """Half the cores, at least one: the engine's ops split over more threads each wait for the slowest, so
    when speech recognition, the language model, speech synthesis and the browser take a core the step stalls
    (docs/app.md, "Sharing the CPU")."""
    return max(1, (os.cpu_count() or 2) // 2)


AUTO = "auto"
AUTO_SPECS = ("demo", "demo-cpu")  # the shipped characters, the largest first
REAL_TIME_MARGIN = 1.25  # auto takes a spec whose steps come this much faster than real time needs


def steps_per_second(loaded: Loaded, options: EngineOptions, spec: ModelSpec, steps: int = 3) -> float:
    """Engine steps a second on this machine, decoding included, after one step to warm up: what auto
    compares against real time (spec.fps / frames_per_latent steps a second)."""
    session = new_session(loaded.model, replace(options, cuda_graph=False))  # eager: no capture to wait for
    session.start(torch.zeros(spec.latent_channels, *spec.latent_grid))
    audio = torch.zeros(spec.audio_window, spec.n_mels, device=loaded.device, dtype=next(loaded.model.parameters()).dtype)
    with torch.no_grad():
        decode_step(loaded.codec, session.step(audio), audio, spec)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize(loaded.device)
        started = time.perf_counter()
        for _ in range(steps):
            frames = decode_step(loaded.codec, session.step(audio), audio, spec)
        frames.cpu()  # decoded frames reach the host, as served
        return steps / (time.perf_counter() - started)


def choose_spec(config: AppConfig, device: torch.device) -> tuple[str, str]:
    """spec auto: the largest shipped character whose measured steps keep real time with REAL_TIME_MARGIN to
    spare, or, where none does, the fastest, said to be below real time. Returns the spec and why."""
    shipped = [name for name in AUTO_SPECS if default_weights(get_spec(name)) is not None]
    if not shipped:
        raise ValueError(f"spec auto needs a shipped character ({', '.join(AUTO_SPECS)}) in assets/")
    tried: list[str] = []
    best: tuple[float, str] | None = None
    for name in shipped:
        spec = get_spec(name)
        candidate = replace(config, spec=name)
        options = engine_options(candidate, device)
        placement = plan_placement(options, spec)
        if placement is not None and placement.diffusion:  # several GPUs: real time is what they are for
            return name, f"{name}: the largest shipped character, on GPUs {list(placement.diffusion)}"
        options = replace(options, gpus=None, tp=1, processes=False)  # measured in this process
        loaded = load(options, spec, None)
        try:
            rate = steps_per_second(loaded, options, spec)
        finally:
            loaded.close()
        needed = spec.fps / spec.frames_per_latent
        tried.append(f"{name} {rate:.1f} steps/s")
        if rate >= REAL_TIME_MARGIN * needed:
            return name, f"{name}: {', '.join(tried)} here; real time needs {needed:.0f} ({REAL_TIME_MARGIN:g}x to spare)"
        if best is None or rate > best[0]:
            best = (rate, name)
    assert best is not None
    rate, name = best
    needed = get_spec(name).fps / get_spec(name).frames_per_latent
    return name, f"{name}, BELOW REAL TIME: {', '.join(tried)} here; real time needs {needed:.0f}"


class EngineHost:
    def __init__(self, config: AppConfig):
        self.device = pick_device(config.device)
        self.choice: str | None = None  # with spec auto: which character was chosen, and why
        if config.spec == AUTO:
            name, self.choice = choose_spec(config, self.device)
            log.info("spec auto: %s", self.choice)
            config = replace(config, spec=name)
        self.config = config
        self.spec: ModelSpec = get_spec(config.spec)
        options = engine_options(config, self.device)
        self.placement = plan_placement(options, self.spec)
        self.cuda_graph = self._graph_replay()
        self.options = replace(options, cuda_graph=self.cuda_graph)
        # Loaded once: the model (when the engine runs in this process) and the codec, which stays in this
        # process to encode each preset's reference picture.
        self.loaded = load(self.options, self.spec, self.placement)
        self.trained = self.loaded.trained
        self._spare = None
        self._spare_lock = threading.Lock()
        self._closed = False  # under _spare_lock: a spare finished after close() is closed, not kept
        if self.placement is not None:
            self._spare = self._new_distributed()

    def _graph_replay(self) -> bool:
        """Whether the engine's step replays as a CUDA graph: asked for, on GPUs, with one diffusion process
        (tensor-parallel ranks step eagerly: their all-reduces are not captured) and the Triton backend."""
        p = self.placement
        if not self.config.cuda_graph or self.device.type != "cuda" or (p is not None and p.tp != 1):
            return False
        if pick_backend("auto", self.device, "ring", "fp8", self.spec.reset_every) != "triton":
            log.warning("CUDA graph off: it needs the Triton backend, which this machine lacks")
            return False
        return True

    @property
    def placement_text(self) -> str:
        graph = ", CUDA graph" if self.cuda_graph else ""
        if self.placement is None:
            threads = f", {self.options.threads} thread(s)" if self.options.threads is not None else ""
            dtype = f", {self.options.dtype}" if self.options.dtype != "auto" else ""
            return f"one process on {self.device}{threads}{dtype}{graph}"
        p = self.placement
        where = f"GPUs {list(p.diffusion)}" if p.diffusion else f"{p.tp} CPU process(es)"
        return f"diffusion on {where}, decoders on {list(p.decoders) or 'the first diffusion device'}{graph}"

    def _new_distributed(self) -> DistributedEngine:
        return start_processes(self.options, self.spec, self.placement)

    def _take_distributed(self):
        with self._spare_lock:
            engine, self._spare = self._spare, None
        if engine is not None and not engine.alive():  # a process of the idle spare died: start afresh
            log.warning("the spare engine lost a process; starting a new one")
            engine.close()
            engine = None
        if engine is None:
            engine = self._new_distributed()
        threading.Thread(target=self._refill_spare, name="talkloop-spare-engine", daemon=True).start()
        return engine

    def _refill_spare(self) -> None:
        try:
            engine = self._new_distributed()
        except Exception:
            log.exception("could not start a spare engine")
            return
        with self._spare_lock:
            if self._spare is None and not self._closed:
                self._spare = engine
                return
        engine.close()

    def new_character(self, preset: str) -> tuple[RealtimeCharacter, DistributedEngine | None]:
        """A started character for a preset, and its distributed engine (None when local)."""
        processes = self._take_distributed() if self.placement is not None else None
        built = build_engine(self.options, self.spec, look=preset, loaded=self.loaded, processes=processes)
        built.character.start()
        return built.character, built.engine

    def close(self) -> None:
        with self._spare_lock:
            self._closed = True
            engine, self._spare = self._spare, None
        if engine is not None:
            engine.close()
