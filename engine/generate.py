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

from engine.audio import SAMPLE_RATE, read_audio
from engine.build import Built, build_engine
from engine.cache import KV_DTYPES
from engine.character import PRESETS
from engine.checkpoint import sha256_of
from engine.config import SPECS, get_spec
from engine.kernels import ATTENTION_KERNELS
from engine.media import Mp4Writer
from engine.options import EngineOptions
from engine.weights import ASSETS, pick_device


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


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def engine_options(args) -> EngineOptions:
    """The flags as engine options. --tp without --gpus runs CPU processes, whatever --device says."""
    return EngineOptions(
        name="generate", spec=args.spec, weights=args.weights, seed=args.seed,
        device="cpu" if args.tp is not None and args.gpus is None else args.device,
        cache="reference" if args.attention == "reference" else "ring", backend=BACKENDS[args.attention],
        attention=args.attention_kernel, kv_dtype=args.kv_dtype, gemm=gemm_mode(args), cuda_graph=args.cuda_graph,
        reset_every=args.reset_every, tp=args.tp or 1, processes=args.tp is not None, gpus=args.gpus,
        decoder_gpu=args.decoder_gpu)


def describe(built: Built, options: EngineOptions, args) -> str:
    """One log line naming the paths the engine runs."""
    if built.engine is not None:
        p = built.engine.placement
        return (f"engine: {p.tp} diffusion process(es) on {list(p.diffusion) or 'cpu'}, "
                f"decoders on {list(p.decoders) or 'the first diffusion device'}")
    session = built.character.session
    kernel = f" attention_kernel={session.cache.attention_kernel}" if session.backend == "triton" else ""
    kv = options.kv_dtype if options.cache == "ring" else "float"
    return (f"engine: cache={options.cache} backend={session.backend}{kernel} kv={kv} "
            f"gemm={args.gemm} cuda_graph={args.cuda_graph} device={session.device}")


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
        options = engine_options(args)
        built = build_engine(options, spec, look=args.preset)
        character, trained, close = built.character, built.trained, built.close
        if not trained and built.engine is None and _rank() == 0:
            print(f"note: no trained weights for spec {spec.name}: random weights, so the picture is noise", file=sys.stderr)
        print(describe(built, options, args), file=sys.stderr)
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
