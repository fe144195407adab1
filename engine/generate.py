"""Offline generation: audio file in, talking-character MP4 out.

    python -m engine.generate --spec demo --out clip.mp4                     # the shipped greeting (assets/hello.wav)
    python -m engine.generate --spec demo --audio speech.wav --out clip.mp4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from engine.audio import SAMPLE_RATE
from engine.cache import KV_DTYPES
from engine.character import PRESETS, reference_image
from engine.config import SPECS, get_spec
from engine.kernels import ATTENTION_KERNELS, apply_gemm_mode_
from engine.media import Mp4Writer, read_audio
from engine.realtime import RealtimeCharacter, RemoteSteps
from engine.session import EngineSession
from engine.weights import ASSETS, load_engine, pick_device, sha256_of


GREETING = ASSETS / "hello.wav"  # said when no --audio is given; lab/eval_speech.py made it with the app's voice
ATTENTION = ("auto", "triton", "sdpa", "reference")
BACKENDS = {"auto": "auto", "triton": "triton", "sdpa": "torch", "reference": "torch"}  # --attention -> session backend


def gemm_mode(args) -> str:
    """--gemm as the engine names it (engine.kernels.GEMM_MODES)."""
    return "plain" if args.gemm == "bf16" else args.gemm


def greeting() -> Path:
    """The shipped greeting, checked against its sha256 like the weights beside it."""
    sidecar = GREETING.with_name(GREETING.name + ".sha256")
    if not GREETING.is_file() or not sidecar.is_file():
        raise ValueError(f"the shipped greeting {GREETING} (or its .sha256) is missing: give --audio a speech file")
    expected, actual = sidecar.read_text().split()[0], sha256_of(GREETING)
    if actual != expected:
        raise ValueError(f"{GREETING} fails its sha256 check: expected {expected}, got {actual}")
    return GREETING


def make_session(model, args) -> EngineSession:
    """The session the flags ask for, with one log line naming the paths it runs."""
    apply_gemm_mode_(model, gemm_mode(args), fuse=next(model.parameters()).is_cuda)
    cache = "reference" if args.attention == "reference" else "ring"
    backend = BACKENDS[args.attention]
    session = EngineSession(model, cache=cache, kv_dtype=args.kv_dtype, reset_every=args.reset_every, seed=args.seed,
                            backend=backend, cuda_graph=args.cuda_graph, attention_options={"kernel": args.attention_kernel})
    kernel = f" attention_kernel={session.cache.attention_kernel}" if session.backend == "triton" else ""
    print(f"engine: cache={cache} backend={session.backend}{kernel} kv={args.kv_dtype if cache == 'ring' else 'float'} "
          f"gemm={args.gemm} cuda_graph={args.cuda_graph} device={session.device}", file=sys.stderr)
    return session


def preset_reference(spec, codec, preset: str) -> torch.Tensor:
    """The preset character's reference picture (engine.character), encoded by the codec."""
    return codec.encode_reference(reference_image(preset, spec.image_size))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def build_character(args, spec, device: torch.device):
    """The character the flags ask for: in this process, under torchrun (this process is one
    tensor-parallel rank), or over processes the engine starts itself (--gpus / --tp).
    Returns (character, trained, close)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.gpus is not None or args.tp:
        from engine.distributed import DistributedEngine, Placement

        if args.gpus is not None:
            placement = Placement.plan(args.gpus, args.decoder_gpu, visible=torch.cuda.device_count(), n_heads=spec.n_heads, mlp_hidden=spec.mlp_hidden)
        else:
            placement = Placement(cpu_ranks=args.tp)
        session_kwargs = dict(cache="reference" if args.attention == "reference" else "ring", kv_dtype=args.kv_dtype,
                              reset_every=args.reset_every, backend=BACKENDS[args.attention], cuda_graph=args.cuda_graph,
                              attention_options={"kernel": args.attention_kernel})
        engine = DistributedEngine(spec, placement, weights=args.weights, seed=args.seed, session=session_kwargs,
                                   gemm=gemm_mode(args))
        _, codec, trained = load_engine(spec, weights=args.weights, seed=args.seed)
        steps = RemoteSteps(engine)
        steps.start(preset_reference(spec, codec, args.preset))
        print(f"engine: {placement.tp} diffusion process(es) on {list(placement.diffusion) or 'cpu'}, "
              f"decoders on {list(placement.decoders) or 'the first diffusion device'}", file=sys.stderr)
        return RealtimeCharacter(steps=steps, lookahead=1), trained, engine.close
    if world > 1:  # launched by torchrun: this process is one rank
        from engine.distributed import _all_reduce
        from engine.parallel import shard_model_

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.type == "cuda":
            device = torch.device(f"cuda:{local}")
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, codec, trained = load_engine(spec, weights=args.weights, device="cpu", seed=args.seed)
    if world > 1:
        shard_model_(model, _rank(), world, reduce=_all_reduce)
    model, codec = model.to(device=device, dtype=dtype), codec.to(device)
    if not trained and _rank() == 0:
        print(f"note: no trained weights for spec {spec.name}: random weights, so the picture is noise", file=sys.stderr)
    session = make_session(model, args)
    session.start(preset_reference(spec, codec, args.preset))
    close = dist.destroy_process_group if world > 1 else (lambda: None)
    return RealtimeCharacter(session, codec), trained, close


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.generate", description=__doc__.strip().splitlines()[0])
    p.add_argument("--spec", default="demo", choices=sorted(SPECS))
    p.add_argument("--audio", default=None, help="any audio file FFmpeg reads (default: the shipped greeting, "
                                                   "assets/hello.wav, 4.8 s in the app's voice)")
    p.add_argument("--out", required=True, help="MP4 to write")
    p.add_argument("--weights", help="checkpoint (default: the one shipped for the spec)")
    p.add_argument("--preset", default="ada", choices=sorted(PRESETS), help="the character to animate")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="triton: FP8 ring + Triton kernels; sdpa: FP8 ring read by PyTorch SDPA; "
                        "reference: the plain path (float cache, read-time RoPE); auto: triton where it runs")
    p.add_argument("--attention-kernel", default="auto", choices=ATTENTION_KERNELS,
                   help="the triton path's FP8 attention kernel: ws (warp-specialised, Hopper GPUs) or triton; auto: ws where it runs")
    p.add_argument("--gemm", default="bf16", choices=("bf16", "fp8", "fp8-fast"),
                   help="block linears in bf16 or FP8; fp8-fast: FP8 with the tensor cores' fast accumulation (GPU)")
    p.add_argument("--cuda-graph", action="store_true", help="replay each step's passes as one CUDA graph (triton only)")
    p.add_argument("--kv-dtype", default="fp8", choices=sorted(KV_DTYPES))
    p.add_argument("--reset-every", type=int, default=None, help="steps between position resets (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="refuse longer audio")
    p.add_argument("--gpus", default=None, help="several GPUs, e.g. 0,1,2,3: one process each, tensor-parallel diffusion")
    p.add_argument("--decoder-gpu", default=None, help="GPU(s) that only decode, e.g. 3 (default with --gpus: the last)")
    p.add_argument("--tp", type=int, default=None, help="without GPUs: tensor-parallel degree in CPU processes")
    args = p.parse_args(argv)
    try:
        spec = get_spec(args.spec)
        device = pick_device(args.device)
        if args.gemm == "fp8-fast" and device.type != "cuda" and args.gpus is None:
            raise ValueError("--gemm fp8-fast needs a CUDA GPU (fast accumulation is a tensor-core mode)")
        if args.attention_kernel != "auto" and args.attention in ("sdpa", "reference"):
            raise ValueError(f"--attention-kernel {args.attention_kernel} is a kernel of the triton path, not of --attention {args.attention}")
        if args.attention_kernel == "ws" and device.type != "cuda" and args.gpus is None:
            raise ValueError("--attention-kernel ws needs a Hopper GPU (sm_90)")
        if not args.out or Path(args.out).is_dir():
            raise ValueError(f"--out {args.out!r} is a folder: give the MP4 file to write, e.g. clip.mp4")
        if not Path(args.out).resolve().parent.is_dir():
            raise ValueError(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
        audio = args.audio if args.audio is not None else greeting()
        pcm = read_audio(audio, max_seconds=args.max_seconds)
        if pcm.size == 0:
            raise ValueError(f"{audio} holds no audio samples")
        character, trained, close = build_character(args, spec, device)
        try:  # the engine (its processes, or the torchrun group) is closed whatever happens below
            character.push_audio(pcm, SAMPLE_RATE)
            n_frames = math.ceil(pcm.size * spec.fps / SAMPLE_RATE)
            steps = math.ceil(n_frames / spec.frames_per_latent)
            t0 = time.perf_counter()
            writer = Mp4Writer(args.out, spec.fps, spec.image_size) if _rank() == 0 else None
            try:
                written = 0
                while written < steps * spec.frames_per_latent:
                    for frame in character.make_step():
                        written += 1
                        if writer is not None:
                            writer.write(frame.rgb, frame.pcm)
            finally:
                if writer is not None:
                    writer.close()  # the fragments written so far stay playable
            elapsed = time.perf_counter() - t0
        finally:
            close()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a file that cannot be written
        print(f"error: writing {args.out}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {args.out} holds the frames written so far", file=sys.stderr)
        return 130
    if _rank() != 0:
        return 0
    print(json.dumps({
        "out": args.out, "audio": str(audio), "spec": spec.name, "trained_weights": trained, "device": str(device),
        "frames": steps * spec.frames_per_latent, "steps": steps,
        "seconds_of_video": steps * spec.frames_per_latent / spec.fps,
        "steps_per_second": steps / elapsed, "wall_seconds": elapsed,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
