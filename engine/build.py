"""Build an engine from `EngineOptions`: the one place a running character is put together.

    built = build_engine(options, spec, look="ada")          # weights loaded, session started
    built.character.push_audio(pcm, 16000)
    frames = built.character.make_step()
    built.close()

In this process (a session on the model, the codec decoding each step), or in the engine's
own processes (`DistributedEngine`: tensor-parallel ranks and decoders, started here) when
the options ask for them. Under torchrun this process is one tensor-parallel rank. A host
that serves many characters loads the weights once (`load`) and may start the processes
ahead (`start_processes`), then hands both to `build_engine` for each character.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.character import reference_image
from engine.config import ModelSpec
from engine.distributed import DistributedEngine, Placement, _all_reduce
from engine.model import CausalVideoDiT
from engine.options import (EngineOptions, apply_gemm_mode_, check_options, codec_dtype, gpu_list, model_dtype, new_session,
                            options_device)
from engine.parallel import apply_tensor_parallel
from engine.playout import PlayoutBuffer
from engine.realtime import RealtimeCharacter, RemoteSteps
from engine.weights import load_engine

if TYPE_CHECKING:
    from engine.codec import Codec


def _nothing() -> None:
    pass


@dataclass
class Loaded:
    """What this process holds: the model (None when the engine's own processes hold theirs), the codec that
    encodes each character's reference (and decodes the steps made here), and whether both are trained weights."""

    model: CausalVideoDiT | None
    codec: Codec
    trained: bool
    device: torch.device
    close: Callable[[], None] = _nothing  # leaves the torchrun group this process joined, if it did


@dataclass
class Built:
    """A started character and what runs it: `engine` is its processes (None when it runs in this one)."""

    character: RealtimeCharacter
    trained: bool
    engine: DistributedEngine | None
    close: Callable[[], None]


def torchrun_world() -> int:
    """Processes in the torchrun group this process was launched in (1: not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan_placement(options: EngineOptions, spec: ModelSpec) -> Placement | None:
    """None: the engine runs in this process. Else where its own processes go: `gpus` through Placement.plan
    ("all": every visible GPU, the plan's default split); else `tp` ranks on GPUs 0..tp-1 (decoders on
    `decoder_gpu`, or beside rank 0) on CUDA, or `tp` CPU processes."""
    if not options.own_processes:
        return None
    if options.gpus is not None:
        gpus = None if options.gpus == "all" else options.gpus
        return Placement.plan(gpus, options.decoder_gpu, visible=torch.cuda.device_count(), n_heads=spec.n_heads,
                              mlp_hidden=spec.mlp_hidden)
    if options_device(options).type == "cuda":
        return Placement(tuple(range(options.tp)), tuple(gpu_list(options.decoder_gpu, "decoder_gpu")))
    return Placement(cpu_ranks=options.tp)


def load(options: EngineOptions, spec: ModelSpec, placement: Placement | None) -> Loaded:
    """The weights this process needs: with a placement, the codec only (on the CPU: it encodes references);
    else the model and codec on the options' device, the model's linears as `options.gemm` asks. Under
    torchrun the model is this rank's shard, on the GPU of its local rank."""
    if placement is not None:
        _, codec, trained = load_engine(spec, weights=options.weights, seed=options.seed)
        return Loaded(None, codec, trained, torch.device("cpu"))
    device, close = options_device(options), _nothing
    if device.type == "cpu" and options.threads is not None:
        torch.set_num_threads(options.threads)  # for the whole process: its one engine's ops
    world = torchrun_world()
    if world > 1:  # launched by torchrun: this process is one rank
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        close = dist.destroy_process_group
    try:
        model, codec, trained = load_engine(spec, weights=options.weights, device="cpu", seed=options.seed)
        if world > 1:
            apply_tensor_parallel(model, dist.get_rank(), world, reduce=_all_reduce)
        model = model.to(device=device, dtype=model_dtype(options, device))
        apply_gemm_mode_(model, options.gemm, fuse=device.type == "cuda")
    except BaseException:
        close()
        raise
    return Loaded(model, codec.to(device=device, dtype=codec_dtype(options)), trained, device, close)


def start_processes(options: EngineOptions, spec: ModelSpec, placement: Placement, *,
                    timeout: float = 300.0) -> DistributedEngine:
    """The engine's own processes under `placement`, loaded and waiting for a character's reference
    (`timeout`: the longest wait for any one answer from them, loading included)."""
    return DistributedEngine(spec, placement, options, timeout=timeout)


def build_engine(options: EngineOptions, spec: ModelSpec, *, look: str, playout: PlayoutBuffer | None = None,
                 loaded: Loaded | None = None, processes: DistributedEngine | None = None) -> Built:
    """A character under `options` with the preset look `look`, its session started (the character's own
    thread is not: `character.start()` runs it in real time, `make_step()` steps it by hand).

    `loaded`: weights this process already holds (else loaded here, and released by `close`); `processes`:
    engine processes already started for these options (else started here when the options place the engine
    in processes of its own). `close` ends the processes and, when this call loaded them, the weights' group."""
    check_options(options, spec)
    placement = plan_placement(options, spec) if processes is None else processes.placement
    if placement is not None and processes is None:
        processes = start_processes(options, spec, placement)
    release = _nothing
    try:
        if loaded is None:
            loaded = load(options, spec, placement)
            release = loaded.close
        reference = loaded.codec.encode_reference(reference_image(look, spec.image_size))
        playout = playout or PlayoutBuffer(fps=spec.fps, prebuffer=options.prebuffer, max_lead=options.max_lead)
        if processes is None:
            session = new_session(loaded.model, options)
            session.start(reference)
            character = RealtimeCharacter(session, loaded.codec, playout=playout, adaptive_lead=options.adaptive_lead,
                                          hold_when_late=options.hold_when_late, group_blend=options.group_blend)
            return Built(character, loaded.trained, None, release)
        steps = RemoteSteps(processes)
        steps.start(reference.cpu())
        character = RealtimeCharacter(steps=steps, playout=playout, lookahead=1, adaptive_lead=options.adaptive_lead,
                                      hold_when_late=options.hold_when_late, group_blend=options.group_blend)
    except BaseException:
        if processes is not None:
            processes.close()
        release()
        raise
    return Built(character, loaded.trained, processes, processes.close)
