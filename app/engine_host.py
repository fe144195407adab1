"""The embedded engine: weights loaded once at start-up, one real-time character per session.

One GPU (or the CPU): the engine runs in this process. Several GPUs, or `gpus` / `tp`
given: one process per diffusion GPU plus decoder processes (`DistributedEngine`); a
spare engine is started ahead so the next session does not wait for weights to load.
"""

from __future__ import annotations

import logging
import threading

import torch

from app.config import AppConfig
from engine.character import reference_image
from engine.config import ModelSpec, get_spec
from engine.playout import PlayoutBuffer
from engine.realtime import LocalSteps, RealtimeCharacter, RemoteSteps
from engine.session import EngineSession, pick_backend
from engine.weights import load_engine, pick_device

log = logging.getLogger(__name__)


class EngineHost:
    def __init__(self, config: AppConfig):
        self.config = config
        self.spec: ModelSpec = get_spec(config.spec)
        self.device = pick_device(config.device)
        self.placement = self._plan_placement()
        # The codec stays in this process: it encodes each preset's reference picture.
        dtype = torch.bfloat16 if self.device.type == "cuda" and self.placement is None else torch.float32
        model, self.codec, self.trained = load_engine(self.spec, weights=config.weights, device="cpu", seed=0)
        self.model = model.to(self.device, dtype) if self.placement is None else None
        if self.model is not None:
            self.codec = self.codec.to(self.device)
        self.cuda_graph = self._graph_replay()
        self._spare = None
        self._spare_lock = threading.Lock()
        self._closed = False  # under _spare_lock: a spare finished after close() is closed, not kept
        if self.placement is not None:
            self._spare = self._new_distributed()

    def _plan_placement(self):
        """None: this process; else the Placement of the engine's own processes."""
        from engine.distributed import Placement

        c = self.config
        visible = torch.cuda.device_count() if self.device.type == "cuda" else 0
        if c.tp is not None:
            if self.device.type == "cuda":
                raise ValueError("tp is for CPU processes; on GPUs give gpus (and decoder_gpu)")
            return Placement(cpu_ranks=c.tp)
        if self.device.type != "cuda":
            if c.gpus or c.decoder_gpu:
                raise ValueError("gpus / decoder_gpu need device cuda")
            return None
        if c.gpus is None and c.decoder_gpu is None and visible <= 1:
            return None
        return Placement.plan(c.gpus, c.decoder_gpu, visible=visible, n_heads=self.spec.n_heads, mlp_hidden=self.spec.mlp_hidden)

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

    def _new_distributed(self):
        from engine.distributed import DistributedEngine

        return DistributedEngine(self.spec, self.placement, weights=self.config.weights, seed=0,
                                 session={"cuda_graph": True} if self.cuda_graph else None)

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

    def new_character(self, preset: str) -> tuple[RealtimeCharacter, object | None]:
        """A started character for a preset, and its distributed engine (None when local)."""
        reference = self.codec.encode_reference(reference_image(preset, self.spec.image_size))
        playout = PlayoutBuffer(fps=self.spec.fps, prebuffer=self.config.prebuffer, max_lead=self.config.max_lead)
        if self.placement is None:
            # FP8 keys and values pay off on GPUs; on the CPU, with no hardware e4m3 conversion, they only
            # add a conversion of the whole window at every attention call.
            session = EngineSession(self.model, kv_dtype="fp8" if self.device.type == "cuda" else "fp32",
                                    cuda_graph=self.cuda_graph)
            session.start(reference)
            character = RealtimeCharacter(steps=LocalSteps(session, self.codec), playout=playout,
                                          adaptive_lead=self.config.adaptive_lead)
            engine = None
        else:
            engine = self._take_distributed()
            steps = RemoteSteps(engine)
            steps.start(reference.cpu())
            character = RealtimeCharacter(steps=steps, playout=playout, lookahead=1, adaptive_lead=self.config.adaptive_lead)
        character.start()
        return character, engine

    def close(self) -> None:
        with self._spare_lock:
            self._closed = True
            engine, self._spare = self._spare, None
        if engine is not None:
            engine.close()
