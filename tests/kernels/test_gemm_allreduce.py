"""The fused GEMM + all-reduce kernel (engine/kernels/gemm_allreduce.py) against the plain path.

The kernel needs a Hopper-class GPU (TMA loads, system-scope flags). On one GPU two ranks
are emulated by two launches on two streams sharing plain buffers; with two GPUs, two
processes use real symmetric memory and NCCL gives the reference sums.

Tolerance: the fused kernel and the reference both round each rank's partial to bf16 and
sum in float32; they differ only in the GEMM's accumulation order, so the largest error
is held to 1% of the largest output (bf16 keeps about 0.4%).
"""

import json
import os
import time

import pytest
import torch

pytest.importorskip("triton")

TOL = 1e-2
SHAPES = [(757, 512, 256), (200, 384, 512)]  # rows (prime, as the production frame), cols, inner


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def make_inputs(rank: int, rows: int, cols: int, inner: int, device, fp8: bool, step: int = 0):
    from engine.kernels.fp8_linear import FP8Linear, quantize_rows

    g = torch.Generator(device=device).manual_seed(1000 * step + rank)
    x = torch.randn(rows, inner, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(cols, inner, device=device, dtype=torch.bfloat16, generator=g) / inner ** 0.5
    epi = dict(gate=torch.randn(cols, device=device, dtype=torch.bfloat16, generator=g),
               residual=torch.randn(rows, cols, device=device, dtype=torch.bfloat16, generator=g),
               residual_gate=torch.randn(cols, device=device, dtype=torch.bfloat16, generator=g))
    if fp8:
        lin = FP8Linear(_linear_with(w))
        x8, sx = quantize_rows(x)
        return x8, lin.weight8, dict(epi, row_scale=sx.view(-1), col_scale=lin.weight_scale.view(-1).contiguous())
    return x, w, epi


def _linear_with(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight.data.copy_(w)
    return lin


def _emulated_worker(rows: int, cols: int, inner: int, fp8: bool, reducers: int, path: str) -> None:
    from engine.kernels.gemm_allreduce import BLOCK_DEFAULTS, READY, gemm_all_reduce_reference, launch, new_flags

    device, world = torch.device("cuda"), 2
    bufs = [torch.zeros(rows, cols, device=device, dtype=torch.bfloat16) for _ in range(world)]
    flags = [new_flags(rows, cols, world, **BLOCK_DEFAULTS).to(device) for r in range(world)]
    buf_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
    streams = [torch.cuda.Stream() for _ in range(world)]
    # Each rank's kernel runs once alone first, its peer's flags pre-raised: a kernel's first launch
    # loads its module, which could wait behind a peer kernel already spinning on the same GPU.
    for r, (x, w, epi) in enumerate(make_inputs(q, rows, cols, inner, device, fp8) for q in range(world)):
        flags[r][int(READY)] = 1
        launch(x, w, torch.empty(rows, cols, device=device, dtype=torch.bfloat16), buf_ptrs, flag_ptrs, r, world, programs=16, reducers=reducers, **epi)
        torch.cuda.synchronize()
        for q in range(world):
            flags[q].copy_(new_flags(rows, cols, world, **BLOCK_DEFAULTS))
    report = {"errors": [], "ranks_equal": [], "flags_at_rest": None}
    for step in range(4):  # repeated calls: the flags must come back to their resting state each time
        inputs = [make_inputs(r, rows, cols, inner, device, fp8, step) for r in range(world)]
        partials = [gemm_all_reduce_reference(x, w, lambda y: y, **epi) for x, w, epi in inputs]
        want = (partials[0].float() + partials[1].float()).to(torch.bfloat16)
        outs = [torch.empty(rows, cols, device=device, dtype=torch.bfloat16) for _ in range(world)]
        torch.cuda.synchronize()
        for r, (x, w, epi) in enumerate(inputs):  # both ranks resident at once: a few SMs each
            with torch.cuda.stream(streams[r]):
                launch(x, w, outs[r], buf_ptrs, flag_ptrs, r, world, programs=16, reducers=reducers, **epi)
        torch.cuda.synchronize()
        report["errors"] += [rel_err(out, want) for out in outs]
        report["ranks_equal"].append(torch.equal(outs[0], outs[1]))  # the same sum, in the same order
    report["flags_at_rest"] = all(torch.equal(flags[r].cpu(), new_flags(rows, cols, world, **BLOCK_DEFAULTS))
                                  for r in range(world))
    with open(path, "w") as f:
        json.dump(report, f)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the fused kernel needs a Hopper-class GPU")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows,cols,inner", SHAPES)
@pytest.mark.parametrize("reducers", [0, 4])
def test_two_emulated_ranks_on_one_gpu_sum_like_the_reference(rows, cols, inner, fp8, reducers, tmp_path):
    """In a child process with a deadline: a protocol bug shows as a hang, which must fail the test, not stop the suite."""
    import multiprocessing

    path = str(tmp_path / "report.json")
    child = multiprocessing.get_context("spawn").Process(target=_emulated_worker, args=(rows, cols, inner, fp8, reducers, path))
    child.start()
    child.join(timeout=120)
    if child.is_alive():
        child.kill()
        pytest.fail("the two emulated ranks did not finish in 120 s (flag protocol stuck)")
    assert child.exitcode == 0
    report = json.load(open(path))
    assert max(report["errors"]) < TOL and all(report["ranks_equal"]) and report["flags_at_rest"], report


def _two_gpu_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    from engine.kernels.gemm_allreduce import SymmetricGemmAllReduce, gemm_all_reduce_reference

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device)
    rows, cols, inner = SHAPES[0]
    errors = {}
    for fp8, reducers, push in ((False, 0, False), (True, 0, False), (True, 12, False), (False, 0, True), (True, 0, True),
                                (True, 12, True)):
        op = SymmetricGemmAllReduce(rows, cols, device, reducers=reducers, push=push)
        for step in range(6):
            x, w, epi = make_inputs(rank, rows, cols, inner, device, fp8, step)
            want = gemm_all_reduce_reference(x, w, lambda y: (dist.all_reduce(y), y)[1], **epi)
            errors[f"fp8={fp8} reducers={reducers} push={push} step={step}"] = rel_err(op(x, w, **epi), want)
        # Captured in a CUDA graph and replayed: the flags reset themselves, no host epoch.
        x, w, epi = make_inputs(rank, rows, cols, inner, device, fp8, 99)
        want = gemm_all_reduce_reference(x, w, lambda y: (dist.all_reduce(y), y)[1], **epi)
        out = torch.empty(rows, cols, device=device, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            op(x, w, out=out, **epi)
        for replay in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            errors[f"fp8={fp8} reducers={reducers} push={push} graph replay {replay}"] = rel_err(out, want)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not hopper() or torch.cuda.device_count() < 2, reason="needs two Hopper-class GPUs")
def test_two_gpus_match_nccl(tmp_path):
    import torch.multiprocessing as mp

    from engine.distributed import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    path = str(tmp_path / "errors")
    ctx = mp.spawn(_two_gpu_worker, args=(2, free_port(), path), nprocs=2, join=False)
    deadline = time.monotonic() + 180  # a stuck flag protocol must fail the test, not stop the suite
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish in 180 s (flag protocol stuck)")
    for rank in range(2):
        errors = json.load(open(f"{path}.{rank}"))
        assert errors and all(e < TOL for e in errors.values()), errors


def test_flag_tables_start_at_rest():
    """READY clear everywhere; DONE raised for every rank, oneself included (nobody reads yet)."""
    from engine.kernels.gemm_allreduce import DONE, READY, new_flags, tile_count

    flags = new_flags(757, 7680, 3, block_m=128, block_n=128)
    READY, DONE = int(READY), int(DONE)
    assert flags.shape == (2, tile_count(757, 7680, 128, 128), 3) == (2, 6 * 60, 3)
    assert flags[READY].sum() == 0
    assert (flags[DONE] == 1).all()


def test_reference_path_sums_partials_over_ranks():
    """The plain path on CPU: epilogue, bf16 partial, then the given reduction."""
    from engine.kernels.gemm_allreduce import gemm_all_reduce_reference

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)
    gate, res, rgate = torch.randn(3, generator=g), torch.randn(5, 3, generator=g), torch.randn(3, generator=g)
    y = gemm_all_reduce_reference(x, w, lambda t: 2 * t, gate=gate, residual=res, residual_gate=rgate)
    want = (2 * ((x @ w.t()) * gate + res * rgate).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


@pytest.mark.skipif(torch.cuda.is_available() and not hopper(), reason="the fused kernel needs a Hopper-class GPU")
@pytest.mark.parametrize("reducers", [0, 2])
def test_one_rank_runs_the_whole_protocol(reducers):
    """World 1 (in Triton's interpreter on the CPU): product, epilogue, the rank's own flags raised and
    cleared, the reduction; two calls in a row, the flags back at rest after each. fp16 operands (the
    interpreter mis-reads bf16 through tensor descriptors; the GPU takes both)."""
    from engine.kernels.gemm_allreduce import gemm_all_reduce_reference, launch, new_flags

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    M, N, K = 40, 48, 64  # ragged tiles at both edges
    x = torch.randn(M, K, generator=g).half().to(device)
    w = (torch.randn(N, K, generator=g) / 8).half().to(device)
    epi = dict(gate=torch.randn(N, generator=g).to(device, torch.bfloat16), residual=torch.randn(M, N, generator=g).to(device, torch.bfloat16),
               residual_gate=torch.randn(N, generator=g).to(device, torch.bfloat16))
    tile = dict(block_m=16, block_n=16)
    buf = torch.zeros(M, N, dtype=torch.bfloat16, device=device)
    flags = new_flags(M, N, 1, **tile).to(device)
    ptrs = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device=device)
    want = gemm_all_reduce_reference(x, w, lambda y: y, **epi)
    for _ in range(2):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=device)
        launch(x, w, out, ptrs(buf), ptrs(flags), 0, 1, block_k=32, programs=5, reducers=reducers, **tile, **epi)
        assert rel_err(out, want) < TOL
        assert torch.equal(flags.cpu(), new_flags(M, N, 1, **tile))


INTERP_SHAPE, INTERP_TILE = (40, 48, 64), dict(block_m=16, block_n=16)


def _interp_inputs(rank: int, call: int):
    g = torch.Generator().manual_seed(100 * call + rank)
    M, N, K = INTERP_SHAPE
    return (torch.randn(M, K, generator=g).half(), (torch.randn(N, K, generator=g) / 8).half(),
            dict(gate=torch.randn(N, generator=g).to(torch.bfloat16), residual=torch.randn(M, N, generator=g).to(torch.bfloat16),
                 residual_gate=torch.randn(N, generator=g).to(torch.bfloat16)))


def _interpreted_rank(rank: int, world: int, bufs: list, flags: list, reducers: int, push: bool, path: str) -> None:
    from engine.kernels.gemm_allreduce import gemm_all_reduce_reference, launch

    # Each process maps the shared buffers at its own addresses, as each GPU maps its peers'.
    buffer_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
    errors = []
    for call in range(3):  # no barrier between calls: a rank may start the next while its peer still reads
        x, w, epi = _interp_inputs(rank, call)
        out = torch.full(INTERP_SHAPE[:2], float("nan"), dtype=torch.bfloat16)
        launch(x, w, out, buffer_ptrs, flag_ptrs, rank, world, block_k=32, programs=5, reducers=reducers, push=push,
               **INTERP_TILE, **epi)
        want = sum(gemm_all_reduce_reference(*_interp_inputs(r, call)[:2], lambda y: y, **_interp_inputs(r, call)[2]).float()
                   for r in range(world))
        errors.append(rel_err(out, want))
    with open(f"{path}.{rank}", "w") as f:
        json.dump(errors, f)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes in Triton's interpreter; GPUs run the tests above")
@pytest.mark.parametrize("reducers,push", [(0, False), (2, False), (0, True), (2, True)])
def test_two_rank_processes_exchange_tiles_through_shared_memory(reducers, push, tmp_path):
    """The whole protocol between two processes on the CPU (interpreter): flags raised on the peer and
    cleared by their owner, partial tiles pulled from (or pushed into) the peer's buffer, three calls
    back to back; each rank's sums within 2% of the reference (the interpreter's fp16 dot rounds its
    products to fp16) and every flag back at rest."""
    import torch.multiprocessing as mp

    from engine.kernels.gemm_allreduce import new_flags

    world = 2
    M, N, _ = INTERP_SHAPE
    bufs = [torch.zeros(((world,) if push else ()) + (M, N), dtype=torch.bfloat16).share_memory_() for _ in range(world)]
    flags = [new_flags(M, N, world, **INTERP_TILE).share_memory_() for _ in range(world)]
    path = str(tmp_path / "errors")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_interpreted_rank, args=(r, world, bufs, flags, reducers, push, path)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        pytest.fail("the two ranks did not finish in 240 s (flag protocol stuck)")
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(world):
        errors = json.load(open(f"{path}.{r}"))
        assert len(errors) == 3 and max(errors) < 2 * TOL, errors
        assert torch.equal(flags[r], new_flags(M, N, world, **INTERP_TILE))


@pytest.mark.skipif(torch.cuda.is_available() and not hopper(), reason="the fused kernel needs a Hopper-class GPU")
def test_bad_launches_are_named():
    from engine.kernels.gemm_allreduce import launch, new_flags

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w = torch.zeros(40, 64, dtype=torch.float16, device=device), torch.zeros(48, 64, dtype=torch.float16, device=device)
    buf, flags = torch.zeros(40, 48, dtype=torch.bfloat16, device=device), new_flags(40, 48, 1, **INTERP_TILE).to(device)
    ptrs = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="shapes do not fit"):
        launch(x, w[:, :32], buf, ptrs(buf), ptrs(flags), 0, 1, **INTERP_TILE)
    with pytest.raises(ValueError, match="reducers must be in"):
        launch(x, w, buf, ptrs(buf), ptrs(flags), 0, 1, programs=4, reducers=4, **INTERP_TILE)
