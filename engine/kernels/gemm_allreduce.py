"""A block's last GEMM fused with its tensor-parallel all-reduce, tile by tile, over symmetric memory.

    y = sum over ranks of  gate ⊙ (x @ wᵀ · row_scale · col_scale) + residual_gate ⊙ residual

(the MLP-out product and the gated combine of a block; `x` and `w` in bf16, or e4m3 with
per-row / per-column scales). One persistent kernel per rank: each program takes the same
output tiles on every rank, and for each tile

  1. multiplies (TMA loads, tensor cores), applies the epilogue and stores the partial tile
     into this rank's symmetric buffer, then raises a `ready` flag for the tile on every peer;
  2. one tile later (so the peers have had the time of a tile to catch up), waits for the
     peers' `ready` flags of its previous tile, sums that tile from every rank's buffer
     (peer buffers read over NVLink), writes the output, and raises `done` on every peer.

With `push`, step 1 writes the partial tile into this rank's slot of every rank's buffer
instead (posted NVLink writes) and step 2 sums the slots of the local buffer. With `reducers`,
some programs only reduce (tiles in the order they are finished) and the others only multiply.

A program only overwrites a tile of its buffer after every peer's `done` for it from the
last call, so calls can follow each other (and be captured in a CUDA graph) without any
host-side epoch: flags are set by the peer and cleared by their owner. While some programs
reduce, others multiply, so the communication hides behind the tensor-core work.

Every rank must make the same calls with the same shapes. The plain path (one GEMM, one
NCCL all-reduce) is `gemm_all_reduce_reference`; engine/distributed.py uses the fused one
only at the steady-state shape, on GPUs with symmetric memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launch import FP_FUSION

READY, DONE = tl.constexpr(0), tl.constexpr(1)  # flag planes
BLOCK_DEFAULTS = dict(block_m=128, block_n=128)  # output tile; every rank must use the same


@triton.jit
def _wait_and_clear(flag_ptr):
    # Owner side: a rank set the flag to 1; take it back to 0 (acquire: its writes are now visible).
    while tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys") != 1:
        pass


@triton.jit
def _wait_all(my_flags, slot, WORLD: tl.constexpr):
    for r in tl.static_range(WORLD):
        _wait_and_clear(my_flags + slot * WORLD + r)
    tl.debug_barrier()


@triton.jit
def _raise_on_all(flag_tables, slot, RANK: tl.constexpr, WORLD: tl.constexpr):
    # Release: every thread's stores before the barrier happen-before a rank sees the flag.
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        flags = tl.load(flag_tables + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + slot * WORLD + RANK, 1, sem="release", scope="sys")


@triton.jit
def _multiply_tile(tile, a_desc, b_desc, row_scale, col_scale, gate, residual, residual_gate, bufs, my_buf, flag_tables,
                   my_flags, M, N, K, num_m, tiles, RANK: tl.constexpr, WORLD: tl.constexpr, PUSH: tl.constexpr,
                   HAS_ROW_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m0 = (tile % num_m) * BLOCK_M
    n0 = (tile // num_m) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k])  # (BLOCK_M, BLOCK_K)
        b = b_desc.load([n0, k])  # (BLOCK_N, BLOCK_K): w is (N, K), K-major as the tensor cores want
        acc = tl.dot(a, b.T, acc)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    if HAS_ROW_SCALE:
        acc *= tl.load(row_scale + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_COL_SCALE:
        acc *= tl.load(col_scale + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_GATE:
        acc *= tl.load(gate + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual + offs, mask=ok, other=0.0).to(tl.float32)
        acc += res * tl.load(residual_gate + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    _wait_all(my_flags, DONE * tiles + tile, WORLD)  # every rank has finished reading this tile from the last call
    part = acc.to(tl.bfloat16)
    if PUSH:  # into slot RANK of every rank's buffer: posted NVLink writes, the sum then reads local memory
        for r in tl.static_range(WORLD):
            dst = tl.load(bufs + r).to(tl.pointer_type(tl.bfloat16)) + RANK * M * N
            tl.store(dst + offs, part, mask=ok)
    else:  # into this rank's buffer, for every rank to pull
        tl.store(my_buf + offs, part, mask=ok)
    _raise_on_all(flag_tables, READY * tiles + tile, RANK, WORLD)


@triton.jit
def _reduce_tile(tile, out, bufs, flag_tables, my_flags, M, N, num_m, tiles,
                 RANK: tl.constexpr, WORLD: tl.constexpr, PUSH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    _wait_all(my_flags, READY * tiles + tile, WORLD)  # every rank's partial of this tile is in its buffer
    rows = (tile % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(WORLD):  # the same order on every rank: identical sums everywhere
        if PUSH:
            src = tl.load(bufs + RANK).to(tl.pointer_type(tl.bfloat16)) + r * M * N
        else:
            src = tl.load(bufs + r).to(tl.pointer_type(tl.bfloat16))
        total += tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + offs, total.to(out.dtype.element_ty), mask=ok)
    _raise_on_all(flag_tables, DONE * tiles + tile, RANK, WORLD)  # our reads of every rank's tile are over


@triton.jit
def _gemm_all_reduce_kernel(a_desc, b_desc, row_scale, col_scale, gate, residual, residual_gate, out,
                            bufs, flag_tables, M, N, K,
                            RANK: tl.constexpr, WORLD: tl.constexpr, PROGRAMS: tl.constexpr, REDUCERS: tl.constexpr,
                            PUSH: tl.constexpr,
                            HAS_ROW_SCALE: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_GATE: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    my_buf = tl.load(bufs + RANK).to(tl.pointer_type(tl.bfloat16))
    my_flags = tl.load(flag_tables + RANK).to(tl.pointer_type(tl.int32))
    pid = tl.program_id(0)
    # Tiles run down the M axis first, so the programs at work share the weight columns they read.
    if REDUCERS == 0:  # every program multiplies its tiles and reduces each one a tile later
        previous = -1
        for tile in range(pid, tiles, PROGRAMS):
            _multiply_tile(tile, a_desc, b_desc, row_scale, col_scale, gate, residual, residual_gate, bufs, my_buf,
                           flag_tables, my_flags, M, N, K, num_m, tiles, RANK, WORLD, PUSH, HAS_ROW_SCALE, HAS_COL_SCALE, HAS_GATE,
                           HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K)
            if previous >= 0:
                _reduce_tile(previous, out, bufs, flag_tables, my_flags, M, N, num_m, tiles, RANK, WORLD, PUSH, BLOCK_M, BLOCK_N)
            previous = tile
        if previous >= 0:
            _reduce_tile(previous, out, bufs, flag_tables, my_flags, M, N, num_m, tiles, RANK, WORLD, PUSH, BLOCK_M, BLOCK_N)
    elif pid < PROGRAMS - REDUCERS:  # multipliers
        for tile in range(pid, tiles, PROGRAMS - REDUCERS):
            _multiply_tile(tile, a_desc, b_desc, row_scale, col_scale, gate, residual, residual_gate, bufs, my_buf,
                           flag_tables, my_flags, M, N, K, num_m, tiles, RANK, WORLD, PUSH, HAS_ROW_SCALE, HAS_COL_SCALE, HAS_GATE,
                           HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K)
    else:  # reducers: tiles in the order the multipliers finish them, summed while the product goes on
        for tile in range(pid - (PROGRAMS - REDUCERS), tiles, REDUCERS):
            _reduce_tile(tile, out, bufs, flag_tables, my_flags, M, N, num_m, tiles, RANK, WORLD, PUSH, BLOCK_M, BLOCK_N)


def tile_count(rows: int, cols: int, block_m: int, block_n: int) -> int:
    return triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n)


def new_flags(rows: int, cols: int, world: int, *, block_m: int, block_n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A rank's flag table (tile, source rank): READY all clear, DONE all raised (nobody is reading yet)."""
    tiles = tile_count(rows, cols, block_m, block_n)
    flags = torch.zeros(2, tiles, world, dtype=torch.int32) if out is None else out.view(2, tiles, world)
    flags.zero_()
    flags[int(DONE)] = 1
    return flags


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, buffer_ptrs: torch.Tensor, flag_ptrs: torch.Tensor,
           rank: int, world: int, *, row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None,
           gate: torch.Tensor | None = None, residual: torch.Tensor | None = None, residual_gate: torch.Tensor | None = None,
           block_m: int = 128, block_n: int = 128, block_k: int | None = None, programs: int | None = None,
           reducers: int = 0, push: bool = False, num_warps: int = 8, num_stages: int = 4) -> torch.Tensor:
    """One rank's launch. `buffer_ptrs` / `flag_ptrs`: int64 device tensors holding every rank's
    (rows, cols) bf16 buffer and flag table addresses; `programs` and `reducers` must be the same on
    every rank. `reducers` = 0: every program multiplies and reduces; else that many programs only
    reduce (tiles as they are finished) while the others only multiply. All programs must be
    resident at once: at most one per SM. `push`: each rank's buffer is (world, rows, cols), a slot
    per rank, and partial tiles are written into every rank's slot instead of pulled from each."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or out.shape != (M, N):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}")
    block_k = block_k or (128 if x.element_size() == 1 else 64)
    tiles = tile_count(M, N, block_m, block_n)
    programs = min(tiles + reducers, programs or torch.cuda.get_device_properties(x.device).multi_processor_count)
    if not 0 <= reducers < programs:
        raise ValueError(f"reducers must be in [0, {programs}), got {reducers}")
    a_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    dummy = out
    args = (a_desc, b_desc, dummy if row_scale is None else row_scale, dummy if col_scale is None else col_scale,
            dummy if gate is None else gate, dummy if residual is None else residual,
            dummy if residual_gate is None else residual_gate, out, buffer_ptrs, flag_ptrs, M, N, K)
    meta = dict(RANK=rank, WORLD=world, PROGRAMS=programs, REDUCERS=reducers, PUSH=push, HAS_ROW_SCALE=row_scale is not None,
                HAS_COL_SCALE=col_scale is not None, HAS_GATE=gate is not None, HAS_RESIDUAL=residual is not None,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    _gemm_all_reduce_kernel[(programs,)](*args, **meta, **FP_FUSION)
    return out


def gemm_all_reduce_reference(x: torch.Tensor, weight: torch.Tensor, reduce, *, row_scale=None, col_scale=None,
                              gate=None, residual=None, residual_gate=None) -> torch.Tensor:
    """The plain path: the product and epilogue in float32, bf16 partial, then `reduce` (e.g. NCCL)."""
    y = x.float() @ weight.float().t()
    if row_scale is not None:
        y = y * row_scale.float().view(-1, 1)
    if col_scale is not None:
        y = y * col_scale.float().view(1, -1)
    if gate is not None:
        y = y * gate.float()
    if residual is not None:
        y = y + residual.float() * residual_gate.float()
    return reduce(y.to(torch.bfloat16))


class SymmetricGemmAllReduce:
    """The fused op for one steady-state shape over a process group (one rank per GPU, NCCL group).

    Allocates a (rows, cols) bf16 buffer ((world, rows, cols) with `push`) and a flag table in
    symmetric memory; every rank constructs it, in the same order, with the same arguments."""

    def __init__(self, rows: int, cols: int, device: torch.device, group=None, *, block_m: int = 128, block_n: int = 128,
                 programs: int | None = None, reducers: int = 0, push: bool = False, **kernel_options):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.rows, self.cols, self.block_m, self.block_n = rows, cols, block_m, block_n
        self.kernel_options = dict(kernel_options, reducers=reducers, push=push)  # + block_k, num_warps, num_stages
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.programs = min(tile_count(rows, cols, block_m, block_n) + reducers, programs or sms)
        self.buffer = symm_mem.empty(((self.world,) if push else ()) + (rows, cols), dtype=torch.bfloat16, device=device)
        tiles = tile_count(rows, cols, block_m, block_n)
        self.flags = symm_mem.empty((2 * tiles * self.world,), dtype=torch.int32, device=device)
        new_flags(rows, cols, self.world, block_m=block_m, block_n=block_n, out=self.flags)
        self._buffer_handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self._flag_handle = symm_mem.rendezvous(self.flags, group.group_name)
        self.buffer_ptrs = torch.tensor(self._buffer_handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor(self._flag_handle.buffer_ptrs, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        self._flag_handle.barrier()  # every rank's flags are set up before any kernel signals

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, **epilogue) -> torch.Tensor:
        if x.shape[0] != self.rows or weight.shape[0] != self.cols:
            raise ValueError(f"built for ({self.rows}, {self.cols}) outputs, got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
        out = torch.empty(self.rows, self.cols, device=x.device, dtype=torch.bfloat16) if out is None else out
        return launch(x, weight, out, self.buffer_ptrs, self.flag_ptrs, self.rank, self.world, block_m=self.block_m,
                      block_n=self.block_n, programs=self.programs, **self.kernel_options, **epilogue)
