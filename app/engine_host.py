"""The embedded engine: weights loaded once at start-up, one real-time character per session.

One GPU (or the CPU): the engine runs in this process. Several GPUs, or `gpus` / `tp`
given: one process per diffusion GPU plus decoder processes (`DistributedEngine`); a
spare engine is started ahead so the next session does not wait for weights to load.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import torch

from app.config import AppConfig
from engine.build import build_engine, load, plan_placement, start_processes
from engine.config import ModelSpec, get_spec
from engine.distributed import DistributedEngine
from engine.options import EngineOptions
from engine.realtime import RealtimeCharacter
from engine.session import pick_backend
from engine.weights import pick_device

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
    return EngineOptions(name="app", spec=c.spec, weights=c.weights, device=c.device, gpus=gpus,
                         decoder_gpu=c.decoder_gpu, tp=c.tp or 1, processes=c.tp is not None,
                         kv_dtype="fp8" if device.type == "cuda" or own else "fp32", cuda_graph=c.cuda_graph,
                         prebuffer=c.prebuffer, max_lead=c.max_lead, adaptive_lead=c.adaptive_lead)


class EngineHost:
    def __init__(self, config: AppConfig):
        self.config = config
        self.spec: ModelSpec = get_spec(config.spec)
        self.device = pick_device(config.device)
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
            return f"one process on {self.device}{graph}"
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
