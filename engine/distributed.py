"""Multi-GPU runtime: one process per GPU, started by the engine itself.

Diffusion ranks form a tensor-parallel group (engine/parallel.py shards each block;
a block ends in one all-reduce). Every rank runs the same `EngineSession` on its
shard with the same seed, so all ranks hold the same latent after each step; rank 0
hands it to a decoder process (round-robin when several), with the step's audio window
(an audio-conditioned codec reads its frames' rows of it) and the rows of the user's voice
(a listening codec reads them), and the decoder decodes step t
while the ranks denoise step t+1. Frames come back in order.

    engine = DistributedEngine(spec, Placement.plan("0,1,2,3", "3", ...), EngineOptions(...))
    engine.start(reference_latent)
    engine.submit_step(features, start_frame, listen)   # non-blocking; listen: (4, 3) rows or None
    index, frames = engine.next_frames()        # (4, H, W, 3) uint8, in step order
    engine.close()

On CPU the group uses gloo (tests run several ranks on one machine); on GPUs, NCCL
with NVLink multicast off. A rank or decoder that dies ends the engine with a clear
error, never a hang; a new engine can be started in its place.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import socket
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.codec import decode_step
from engine.config import ModelSpec, shard_spec
from engine.kernels import GEMM_MODES
from engine.options import EngineOptions, apply_gemm_mode_, codec_dtype, model_dtype, new_session
from engine.parallel import TensorParallelBlock, apply_tensor_parallel

# Multicast can take a shared host's GPUs out of service; keep it off for every child process.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


@dataclass(frozen=True)
class Placement:
    """Which device does what. Empty `diffusion` means CPU processes (`cpu_ranks` of them)."""

    diffusion: tuple[int, ...] = ()
    decoders: tuple[int, ...] = ()  # empty: rank 0 decodes on its own device
    cpu_ranks: int = 1

    @property
    def tp(self) -> int:
        return len(self.diffusion) or self.cpu_ranks

    @staticmethod
    def plan(gpus: str | None, decoder_gpus: str | None, *, visible: int, n_heads: int, mlp_hidden: int) -> "Placement":
        """Placement from `--gpus 0,1,2,3 --decoder-gpu 3` style flags, or a default for the GPUs visible.

        Default: one GPU shares diffusion and decoding; with more, the last GPU decodes and the
        largest tensor-parallel degree that divides both the heads and the MLP width (a rank holds whole
        heads and an equal share of the MLP) takes the rest (leftovers decode too).
        """
        def parse(text: str | None, what: str) -> list[int]:
            if text is None or text.strip() == "":
                return []
            try:
                ids = [int(t) for t in text.split(",")]
            except ValueError:
                raise ValueError(f"{what} must be comma-separated GPU indices, got {text!r}") from None
            if len(set(ids)) != len(ids):
                raise ValueError(f"{what} lists a GPU twice: {text!r}")
            for i in ids:
                if i < 0 or i >= visible:
                    raise ValueError(f"GPU {i} in {what} is not visible ({visible} GPU(s) visible)")
            return ids

        chosen = parse(gpus, "--gpus") if gpus is not None else list(range(visible))
        decoders = parse(decoder_gpus, "--decoder-gpu")
        if not chosen:
            if decoders:
                raise ValueError("--decoder-gpu needs GPUs for diffusion too")
            return Placement()
        if not decoders and len(chosen) >= 2:
            decoders = [chosen[-1]]
        diffusion = [g for g in chosen if g not in decoders] or chosen[:1]
        fits = [d for d in range(1, len(diffusion) + 1) if n_heads % d == 0 and mlp_hidden % d == 0]
        tp = max(fits)
        if gpus is not None and decoder_gpus is not None and tp != len(diffusion):
            raise ValueError(f"{len(diffusion)} diffusion GPUs cannot split {n_heads} heads and an MLP width of {mlp_hidden} "
                             f"evenly; give {' or '.join(map(str, fits))} diffusion GPU(s)")
        decoders += [g for g in diffusion[tp:] if g not in decoders]
        return Placement(tuple(diffusion[:tp]), tuple(decoders))


def end_process(p, wait_s: float = 5.0) -> None:
    """Wait for a process told to exit; then SIGTERM; then, if it handles or ignores that (or is stuck in a driver
    call), SIGKILL, which it cannot."""
    p.join(timeout=wait_s)
    if p.is_alive():
        p.terminate()
        p.join(timeout=wait_s)
    if p.is_alive():
        p.kill()
        p.join(timeout=wait_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(y: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(y)
    return y


class OverlappedCombine:
    """A tensor-parallel block's combine with its all-reduce overlapped with the MLP-out GEMM.

    Rows are cut into chunks: each chunk's product is reduced asynchronously while the
    next chunk is computed. Used at the steady-state shape only, after `warmup` calls;
    any other shape, and the first calls, take the plain path (one GEMM, one all-reduce).
    Called with the block whose MLP-out it multiplies by.
    """

    def __init__(self, rows: int, chunks: int = 4, warmup: int = 8):
        self.rows, self.chunks, self.warmup = rows, chunks, warmup
        self.calls = 0

    def __call__(self, block, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if a.ndim != 2 or a.shape[0] != self.rows or self.calls <= self.warmup:
            return _all_reduce(gate_attn * a + gate_mlp * block.mlp_out(s))
        y = torch.empty_like(a)
        bounds = torch.linspace(0, self.rows, self.chunks + 1).round().long().tolist()
        pending = []
        for lo, hi in zip(bounds, bounds[1:]):
            y[lo:hi] = gate_attn * a[lo:hi] + gate_mlp * block.mlp_out(s[lo:hi])
            pending.append(dist.all_reduce(y[lo:hi], async_op=True))
        for work in pending:
            work.wait()
        return y


class SymmetricCombine:
    """A tensor-parallel block's combine as one kernel on GPUs: the MLP-out GEMM tile by tile, the gated sum
    in its epilogue, and the all-reduce over symmetric memory (engine/kernels/gemm_allreduce.py).

    `__call__` is a bf16 block's combine; `fp8` a fused FP8 block's `combine_quantized` (activations already
    quantised). One op (buffer + flags) serves every block, since blocks run one after another. The first
    `warmup` calls and any other shape take the plain path (the GEMM, then NCCL). Called with the block
    whose MLP-out it multiplies by.
    """

    def __init__(self, rows: int, op, warmup: int = 1):
        self.rows, self.op, self.warmup = rows, op, warmup
        self.calls = 0

    def _fused_now(self, rows: int) -> bool:
        self.calls += 1
        return rows == self.rows and self.calls > self.warmup

    def __call__(self, block, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        if a.ndim != 2 or not self._fused_now(a.shape[0]):
            return _all_reduce(gate_attn * a + gate_mlp * block.mlp_out(s))
        return self.op(s.contiguous(), block.mlp_out.weight, gate=gate_mlp.contiguous(), residual=a.contiguous(),
                       residual_gate=gate_attn.contiguous())

    def fp8(self, block, m8: torch.Tensor, sm: torch.Tensor, a: torch.Tensor, gate_attn: torch.Tensor,
            gate_mlp: torch.Tensor) -> torch.Tensor:
        lin = block.mlp_out
        if not self._fused_now(m8.shape[0]):
            from engine.kernels.fused_block import (
                gated_sum,  # Triton, an optional dependency: FP8 blocks only
            )

            return block.reduce(gated_sum(a, lin.forward_quantized(m8, sm), gate_attn, gate_mlp))
        return self.op(m8, lin.weight8, row_scale=sm.view(-1), col_scale=lin.weight_scale.view(-1), gate=gate_mlp,
                       residual=a, residual_gate=gate_attn)


class CombiningBlock(TensorParallelBlock):
    """A tensor-parallel block whose combine is `combine` (an OverlappedCombine or a SymmetricCombine: the
    MLP-out GEMM and the all-reduce together); built on `block`'s parts, its reduction kept for other paths."""

    def __init__(self, block: TensorParallelBlock, combine: OverlappedCombine | SymmetricCombine):
        super().__init__(block, block.reduce)
        self.combiner = combine

    def combine(self, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        return self.combiner(self, a, s, gate_attn, gate_mlp)


def apply_overlapped_combine(model, rows: int, **options):
    """Swap every tensor-parallel block for one whose combine overlaps its all-reduce with MLP-out, chunk by chunk
    (`options`: OverlappedCombine's). Returns the model."""
    for index, block in enumerate(model.blocks):
        model.blocks[index] = CombiningBlock(block, OverlappedCombine(rows, **options))
    return model


def apply_symmetric_combine(model, rows: int, device: torch.device, **options):
    """Swap every tensor-parallel block of a model on a GPU for one that combines through one fused GEMM +
    all-reduce op shared by all (`options`: the op's program layout, e.g. push=True): a fused FP8 block for a
    FusedBlock with that op as its `combine_quantized`, a CombiningBlock for the rest. Returns the model."""
    # Triton, an optional dependency: the symmetric combine runs on GPUs only
    from engine.fused_block import FusedBlock
    from engine.kernels.gemm_allreduce import SymmetricGemmAllReduce

    op = SymmetricGemmAllReduce(rows, model.spec.dim, device, **options)
    for index, block in enumerate(model.blocks):
        combine = SymmetricCombine(rows, op)
        if isinstance(block, FusedBlock):
            model.blocks[index] = block.variant(combine_quantized=combine.fp8)
        else:
            model.blocks[index] = CombiningBlock(block, combine)
    return model


@dataclass
class _Job:
    spec: ModelSpec
    options: EngineOptions  # weights, seeds, the session's settings, gemm, fused_allreduce


def _device_for(placement: Placement, rank: int) -> torch.device:
    return torch.device(f"cuda:{placement.diffusion[rank]}") if placement.diffusion else torch.device("cpu")


PARENT_POLL_S = 1.0  # how often a waiting worker checks that the process that started it is still there


def _get_while_parent_lives(source):
    """The queue's next item; the process exits if its parent died meanwhile. Killed outright (SIGKILL, the OOM
    killer, a timeout's SIGTERM) the parent never closes its engine, and a worker waiting on its queue would
    otherwise hold its GPU for good: the parent's end of the queue never closes in the worker, which holds it too."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return source.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                os._exit(1)


def _decoder_window(session, features: torch.Tensor | None, start_frame: int | None) -> torch.Tensor:
    """The audio window (audio_window, n_mels) of the step the session makes next, for its decoder: cut from the
    features handed with the step when they cover it (as RealtimeCharacter hands them: float32, on the CPU),
    else the session's own (features pushed before, silence where none), on its device until the step is done."""
    spec = session.spec
    first = session.next_frame - spec.audio_context
    if features is not None and start_frame is not None and start_frame <= first \
            and start_frame + features.shape[0] >= first + spec.audio_window:
        return features[first - start_frame:first - start_frame + spec.audio_window].float()
    return session._audio_window().float()


def _decoder_item(index: int, latent: torch.Tensor, window: torch.Tensor, listen: torch.Tensor | None,
                  step_ms: float) -> tuple:
    """What rank 0 puts on a decoder's queue for one step: its index, latent, audio window (on the CPU), the rows
    of the user's voice (on the CPU; None: silence) and the step's diffusion time. `_decoder_worker` unpacks it."""
    window = window.cpu() if window.device.type != "cpu" else window.clone()
    return index, latent, window, None if listen is None else listen.detach().float().cpu(), step_ms


def _diffusion_worker(rank: int, placement: Placement, port: int, job: _Job, commands, latents: list, outbox) -> None:
    try:
        from engine.weights import load_engine

        device = _device_for(placement, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # CPU ranks share the cores: oversubscribed threads make every all-reduce wait on spinning peers
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (placement.tp + 1)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=placement.tp)
        options = job.options
        model, _, _ = load_engine(job.spec, weights=options.weights, device="cpu", seed=options.seed)
        apply_tensor_parallel(model, rank, placement.tp, reduce=_all_reduce)
        model = model.to(device=device, dtype=model_dtype(options, device))
        # Each rank quantises its own shard (per-channel scales of the columns it holds). The MLP branch stays
        # in line on tensor-parallel ranks (docs/kernels.md).
        apply_gemm_mode_(model, options.gemm, fuse=device.type == "cuda", branch_streams=False)
        if options.fused_allreduce and device.type == "cuda":  # push layout: docs/kernels.md
            apply_symmetric_combine(model, job.spec.frame_tokens, device, push=True)
        elif options.fused_allreduce:
            apply_overlapped_combine(model, job.spec.frame_tokens)
        session = new_session(model, options)
        sent: deque[torch.Tensor] = deque(maxlen=16)
        outbox.put(("ready", rank, None))
        while True:
            cmd, *args = _get_while_parent_lives(commands)
            if cmd == "exit":  # the decoders are done (or given up on): what is still queued for them can go
                for q in latents:
                    q.cancel_join_thread()
                break
            if cmd == "stop":  # close(): no more steps. Rank 0 ends its decoders' queues behind the latents it sent,
                # then this process stays (holding those latents) until close() has seen the decoders finish
                if rank == 0:
                    for q in latents:
                        q.put(None)
                continue
            if cmd == "start":
                session.start(args[0])
            elif cmd == "step":
                features, start_frame, index, listen = args
                if features is not None:
                    session.push_audio_features(features, start_frame)
                window = _decoder_window(session, features, start_frame) if rank == 0 else None
                t0 = time.perf_counter()
                latent = session.step()
                if device.type == "cuda":
                    # GPU to GPU: the decoder process maps this buffer through CUDA IPC and copies it to its
                    # own device. A ring of recent latents keeps each one alive while a decoder may read it.
                    latent = latent.float()
                    sent.append(latent)
                    torch.cuda.current_stream(device).synchronize()
                else:
                    latent = latent.float().clone()
                if rank == 0:  # straight to its decoder, which decodes it while the ranks make the next step
                    item = _decoder_item(index, latent, window, listen, 1000 * (time.perf_counter() - t0))
                    latents[index % len(latents)].put(item)
    except BaseException:
        outbox.put(("error", f"diffusion rank {rank}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _decoder_worker(slot: int, device_index: int | None, job: _Job, latents, outbox) -> None:
    try:
        from engine.weights import load_engine

        device = torch.device(f"cuda:{device_index}") if device_index is not None else torch.device("cpu")
        if device.type == "cpu":
            torch.set_num_threads(1)
        _, codec, _ = load_engine(job.spec, weights=job.options.weights, device=device, seed=job.options.seed)
        codec = codec.to(dtype=codec_dtype(job.options))
        outbox.put(("ready", slot, None))
        decoded = 0
        while True:
            item = _get_while_parent_lives(latents)
            if item is None:
                outbox.put(("done", slot, decoded))
                break
            decoded += 1
            index, latent, window, listen, step_ms = item
            t0 = time.perf_counter()
            frames = decode_step(codec, latent.to(device), window, job.spec, listen).cpu()
            del latent  # release the producer's buffer mapping
            outbox.put(("frames", index, {"frames": frames, "step_ms": step_ms, "decode_ms": 1000 * (time.perf_counter() - t0)}))
    except BaseException:
        outbox.put(("error", f"decoder {slot}", traceback.format_exc()))


class DistributedEngine:
    TIMINGS_KEPT = 4096  # steps of `timings` kept: 11 minutes of video at 6 steps a second

    def __init__(self, spec: ModelSpec, placement: Placement, options: EngineOptions = EngineOptions(), *,
                 decoders: int | None = None, timeout: float = 300.0):
        """Start the processes: every rank loads `options.weights` (or random weights from `options.seed`), shards
        them, and runs the session `options` describe; `options.fused_allreduce` overlaps each block's all-reduce."""
        if options.gemm not in GEMM_MODES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_MODES)}, got {options.gemm!r}")
        shard_spec(spec, placement.tp)  # a degree the spec cannot split fails here, not in every rank process
        self.spec, self.placement, self.options, self.timeout = spec, placement, options, timeout
        job = _Job(spec, options)
        self.reset_every = spec.reset_interval(options.reset_every)  # steps between position resets (0: never)
        ctx = mp.get_context("spawn")
        port = free_port()
        n_dec = decoders if decoders is not None else max(len(placement.decoders), 1)
        dec_devices = list(placement.decoders) or ([placement.diffusion[0]] if placement.diffusion else [None])
        self._outbox = ctx.Queue()  # ready / frames / error, from every process
        self._commands = [ctx.Queue() for _ in range(placement.tp)]
        self._latents = [ctx.Queue() for _ in range(n_dec)]
        self._ranks = [ctx.Process(target=_diffusion_worker, args=(r, placement, port, job, self._commands[r], self._latents, self._outbox),
                                   daemon=True, name=f"talkloop-diffusion-{r}") for r in range(placement.tp)]
        self._decoders = [ctx.Process(target=_decoder_worker, args=(i, dec_devices[i % len(dec_devices)], job, self._latents[i], self._outbox),
                                      daemon=True, name=f"talkloop-decoder-{i}") for i in range(n_dec)]
        self._procs = self._ranks + self._decoders
        self.submitted = 0
        self._ready: dict[int, dict] = {}
        # per step: step_ms (diffusion, rank 0), decode_ms, delivered (monotonic s); the latest TIMINGS_KEPT, so that
        # a session of hours does not grow it without bound
        self.timings: deque[dict] = deque(maxlen=self.TIMINGS_KEPT)
        self._next = 0
        self.closed = False
        self.uncollected_at_close: int | None = None  # steps decoded, never collected: known once close() has drained
        for p in self._procs:
            p.start()
        for _ in self._procs:
            self._get(self.timeout)

    # Supervision ---------------------------------------------------------------------
    def _check_alive(self) -> None:
        for p in self._procs:
            if not p.is_alive() and p.exitcode not in (0, None):
                self._close(drain=False)  # something failed: no waiting on the processes
                raise RuntimeError(f"{p.name} died (exit code {p.exitcode}); start a new engine to continue")

    def _get(self, timeout: float):
        waited = 0.0
        while True:
            try:
                item = self._outbox.get(timeout=0.5)
            except queue.Empty:
                waited += 0.5
                self._check_alive()
                if waited >= timeout:
                    self._close(drain=False)  # something failed: no waiting on the processes
                    raise RuntimeError(f"no answer from the engine processes in {timeout:.0f} s") from None
                continue
            except (OSError, EOFError) as e:  # a process died while its tensor was being handed over
                for _ in range(20):  # its sockets close before it can be reaped: give the death a moment to show
                    self._check_alive()
                    time.sleep(0.1)
                self._close(drain=False)  # something failed: no waiting on the processes
                raise RuntimeError(f"lost a message from the engine processes ({type(e).__name__}: {e}); "
                                   "start a new engine to continue") from e
            if item[0] == "error":
                # A peer's death shows first as an error in the ranks still talking to it: name the dead one.
                for _ in range(20):
                    self._check_alive()
                    time.sleep(0.1)
                self._close(drain=False)  # something failed: no waiting on the processes
                raise RuntimeError(f"{item[1]} failed:\n{item[2]}")
            return item

    # Session ---------------------------------------------------------------------------
    def _send(self, *cmd) -> None:
        if self.closed:
            raise RuntimeError("engine is closed; start a new one")
        self._check_alive()
        for q in self._commands:
            q.put(cmd)

    def start(self, reference_latent: torch.Tensor) -> None:
        self._send("start", reference_latent.detach().float().cpu())

    def submit_step(self, features: torch.Tensor | None = None, start_frame: int | None = None,
                    listen: torch.Tensor | None = None) -> int:
        """Queue one step on every rank (its latent then goes to a decoder, with `listen`, the step's rows
        (4, LISTEN_FEATURES) of the user's voice; None: silence); returns its index."""
        index = self.submitted
        heard = None if listen is None else listen.detach().float().cpu()
        self._send("step", None if features is None else features.detach().float().cpu(), start_frame, index, heard)
        self.submitted += 1
        return index

    def next_frames(self) -> tuple[int, torch.Tensor]:
        """The next step's decoded frames (4, H, W, 3) uint8, in step order."""
        if self._next >= self.submitted:
            raise ValueError("no step submitted whose frames are still to come")
        while self._next not in self._ready:
            kind, index, payload = self._get(self.timeout)
            if kind == "frames":
                self._ready[index] = payload
        index = self._next
        self._next += 1
        payload = self._ready.pop(index)
        self.timings.append({"step_ms": payload["step_ms"], "decode_ms": payload["decode_ms"], "delivered": time.monotonic()})
        return index, payload["frames"]

    def alive(self) -> bool:
        """Open, with every one of its processes still running (a spare engine held idle can lose one unseen)."""
        return not self.closed and all(p.is_alive() for p in self._procs)

    def pids(self) -> dict[str, int]:
        """Process name -> pid of every engine process (memory figures, fault injection)."""
        return {p.name: p.pid for p in self._procs if p.pid is not None}

    def kill_process(self, name: str) -> None:
        """SIGKILL one engine process by name, e.g. 'talkloop-decoder-0' (fault injection: a crash, no goodbye)."""
        pids = self.pids()
        if name not in pids:
            raise ValueError(f"no engine process named {name!r}; have {', '.join(pids)}")
        os.kill(pids[name], signal.SIGKILL)

    def close(self) -> None:
        """Stop every process. The steps still submitted are finished and decoded (their frames dropped, counted in
        `uncollected_at_close`) before any rank exits: a rank that exits while a decoder still maps its latents
        (through CUDA IPC) leaves them in use past its end. Bounded: after 5 s the processes are stopped anyway."""
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            for q in self._commands:  # the ranks finish what was submitted; rank 0 then ends its decoders' queues
                q.put(("stop",))
            if drain and all(p.is_alive() for p in self._procs):
                self._drain_decoders(deadline=time.monotonic() + 5.0)
        finally:
            for q in self._latents:  # decoders still waiting: rank 0 gone, stuck, or no drain
                q.put(None)
            for q in self._commands:
                q.put(("exit",))
            for p in self._decoders + self._ranks:
                end_process(p)
            for q in self._commands + self._latents:  # the queues this process writes to
                # A process killed while it held a queue's write lock (a crash, or fault injection) never releases
                # it: this process's feeder thread would wait for it forever, and Python joins feeder threads at
                # exit. The processes are gone, so what is still buffered for them can be dropped.
                q.cancel_join_thread()

    def _drain_decoders(self, deadline: float) -> None:
        """Wait for each decoder's word that it has decoded all it was sent, reading (and dropping) the frames of
        the steps no one collected meanwhile: a process cannot exit while its queue holds more than the pipe
        takes and no one reads it. `uncollected_at_close`: those steps, counted from the decoders' totals."""
        decoded: dict[int, int] = {}

        def can_still_answer() -> bool:  # every decoder yet to answer lives, and so does rank 0 that ends their queues
            pending = [p for slot, p in enumerate(self._decoders) if slot not in decoded]
            return all(p.is_alive() for p in pending) and self._ranks[0].is_alive()

        last_look = False
        while len(decoded) < len(self._decoders) and time.monotonic() < deadline:
            try:
                kind, slot, payload = self._outbox.get(timeout=0.05)
            except queue.Empty:
                if last_look:
                    return
                last_look = not can_still_answer()  # what a gone process sent before its end is still in the pipe
                continue
            except Exception:  # frames whose decoder exited before they were read (their memory went with it), or
                continue  # a message cut short by an interrupted read: the deadline bounds this
            if kind == "done":
                decoded[slot] = payload
            elif kind == "error":  # a process failed: no decoder's word will come from there
                return
        if len(decoded) == len(self._decoders):
            self.uncollected_at_close = sum(decoded.values()) - self._next

    def __enter__(self) -> "DistributedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
