"""Multi-process runtime on CPU (gloo): tensor parallelism, the overlapped all-reduce, the decoder
pipeline, placement and failures. Tolerance for TP vs one process: decoded frames within 1/255
(the all-reduce adds partial sums in another order than one matmul does)."""

import os
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import get_spec
from engine.codec import StandInCodec
from engine.distributed import DistributedEngine, OverlappedCombine, Placement, free_port
from engine.model import build_model
from engine.options import EngineOptions
from engine.parallel import apply_tensor_parallel
from engine.session import EngineSession
from tests.helpers import TINY, reference_latent, run_script

SPEC6 = TINY.with_(name="tiny6", dim=96, n_heads=6, mlp_hidden=192)  # heads split 2 and 3 ways
STEPS = 7


def features(step: int) -> torch.Tensor:
    return torch.randn(SPEC6.frames_per_latent, SPEC6.n_mels, generator=torch.Generator().manual_seed(step))


def single_process_frames(model=None) -> torch.Tensor:
    model = build_model(SPEC6, seed=0) if model is None else model
    session = EngineSession(model, seed=0)
    session.start(reference_latent(SPEC6))
    codec = StandInCodec(SPEC6, seed=0)
    out = []
    for t in range(STEPS):
        session.push_audio_features(features(t), t * 4)
        out.append(codec.decode(session.step()))
    return torch.stack(out)


def engine_frames(engine: DistributedEngine) -> tuple[list[int], torch.Tensor]:
    engine.start(reference_latent(SPEC6))
    for t in range(STEPS):
        engine.submit_step(features(t), t * 4)
    got = [engine.next_frames() for _ in range(STEPS)]
    return [i for i, _ in got], torch.stack([f for _, f in got])


@pytest.fixture(scope="module")
def expected():
    return single_process_frames()


@pytest.mark.parametrize("tp, overlap", [(1, False), (2, False), (3, False), (2, True)])
def test_tensor_parallel_frames_equal_one_process(expected, tp, overlap):
    with DistributedEngine(SPEC6, Placement(cpu_ranks=tp), EngineOptions(fused_allreduce=overlap), timeout=120) as engine:
        order, frames = engine_frames(engine)
    assert order == list(range(STEPS))
    assert (frames.int() - expected.int()).abs().max().item() <= 1


def test_fp8_linears_in_tensor_parallel_ranks_match_one_process(expected):
    """gemm=fp8 in the engine's own processes: each rank quantises its shard (per-channel scales of
    the columns it holds, per-token scales of its slice of the row-parallel inputs), so the
    numbers differ from one process's FP8 by rounding only. Tolerance: mean |difference| <= 1
    level of 255, none above 16; and nearer to one process's FP8 frames than to the float ones
    (the ranks really ran in FP8)."""
    from engine.fused_block import apply_fp8_kernels

    one = single_process_frames(apply_fp8_kernels(build_model(SPEC6, seed=0), fuse=False)).float()
    with DistributedEngine(SPEC6, Placement(cpu_ranks=2), EngineOptions(gemm="fp8"), timeout=120) as engine:
        _, two = engine_frames(engine)
    diff = (two.float() - one).abs()
    assert diff.mean().item() <= 1.0 and diff.max().item() <= 16, (diff.mean().item(), diff.max().item())
    assert diff.mean() < (two.float() - expected.float()).abs().mean()


def test_several_decoders_deliver_every_step_in_order(expected):
    with DistributedEngine(SPEC6, Placement(cpu_ranks=1), decoders=3, timeout=120) as engine:
        order, frames = engine_frames(engine)
    assert order == list(range(STEPS))
    assert (frames.int() - expected.int()).abs().max().item() <= 1


def test_a_dead_rank_gives_a_clear_error_and_a_new_engine_starts():
    engine = DistributedEngine(SPEC6, Placement(cpu_ranks=2), timeout=60)
    engine.start(reference_latent(SPEC6))
    engine.kill_process("talkloop-diffusion-1")  # a rank dies mid-session
    with pytest.raises(RuntimeError, match="died|failed|no answer"):
        for t in range(3):
            engine.submit_step(features(t), t * 4)
            engine.next_frames()
    assert engine.closed
    with DistributedEngine(SPEC6, Placement(cpu_ranks=1), timeout=120) as fresh:
        fresh.start(reference_latent(SPEC6))
        fresh.submit_step(features(0), 0)
        assert fresh.next_frames()[0] == 0


def test_closing_decodes_the_steps_still_in_flight_before_the_ranks_exit():
    """Steps submitted but not collected are decoded while the engine closes, and the decoders are done before
    any rank exits (on a GPU, rank 0's latents reach the decoders through CUDA IPC: a rank that exits first
    leaves them mapped past its end)."""
    engine = DistributedEngine(SPEC6, Placement(cpu_ranks=2), decoders=2, timeout=120)
    engine.start(reference_latent(SPEC6))
    for t in range(5):
        engine.submit_step(features(t), t * 4)
    assert engine.next_frames()[0] == 0
    for q in engine._commands:  # close()'s first half, to look between the halves
        q.put(("stop",))
    engine._drain_decoders(deadline=time.monotonic() + 60)
    for p in engine._decoders:
        p.join(timeout=30)
    assert [p.exitcode for p in engine._decoders] == [0, 0]  # finished on their own
    assert all(p.is_alive() for p in engine._ranks)  # the ranks still hold what they sent
    assert engine.uncollected_at_close == 4
    engine.close()
    assert [p.exitcode for p in engine._ranks] == [0, 0]


def test_an_engine_closed_by_a_failure_does_not_wait_for_its_decoders():
    """A decoder that reported an error will send no word that it is done: the close that the error causes
    stops the processes without waiting for one."""
    engine = DistributedEngine(SPEC6, Placement(cpu_ranks=1), timeout=120)
    drains = []
    engine._drain_decoders = lambda deadline: drains.append(deadline)
    engine.start(reference_latent(SPEC6))
    engine._latents[0].put("not a step")  # the decoder fails on it and reports the error
    with pytest.raises(RuntimeError, match="decoder 0 failed"):
        engine.submit_step(features(0), 0)
        engine.next_frames()
    assert engine.closed and drains == []
    assert [p.is_alive() for p in engine._procs] == [False, False]


HELD_LOCK_SCRIPT = """
import multiprocessing as mp, os, signal, sys
from engine.distributed import DistributedEngine, Placement
from tests.helpers import TINY


def hold(lock, taken):  # an engine process that dies in the middle of a put: the queue's write lock stays taken
    lock.acquire()
    taken.set()
    signal.pause()


if __name__ == "__main__":
    engine = DistributedEngine(TINY.with_(name="tiny6", dim=96, n_heads=6, mlp_hidden=192), Placement(cpu_ranks=1), timeout=60)
    ctx = mp.get_context("spawn")
    taken = ctx.Event()
    holder = ctx.Process(target=hold, args=(engine._latents[0]._wlock, taken))
    holder.start()
    assert taken.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    engine.close()  # puts a stop into that queue: its feeder thread now waits for the lock forever
    print("closed", flush=True)
"""


def test_closing_after_a_process_died_holding_a_queue_lock_does_not_hang_the_exit(tmp_path):
    done = run_script(tmp_path / "held_lock.py", HELD_LOCK_SCRIPT, timeout=120)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr


@torch.no_grad()
def _combine_worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = apply_tensor_parallel(build_model(SPEC6, seed=0), rank, 2)
    block = model.blocks[0]
    g = torch.Generator().manual_seed(10 + rank)
    a = torch.randn(SPEC6.frame_tokens, SPEC6.dim, generator=g)
    s = torch.randn(SPEC6.frame_tokens, SPEC6.mlp_hidden // 2, generator=g)
    ga, gm = torch.randn(SPEC6.dim, generator=g), torch.randn(SPEC6.dim, generator=g)
    plain = ga * a + gm * block.mlp_out(s)
    dist.all_reduce(plain)
    fused = OverlappedCombine(SPEC6.frame_tokens, chunks=3, warmup=0)(block, a, s, ga, gm)
    if rank == 0:
        torch.save({"plain": plain, "fused": fused, "calls": 1}, path)
    dist.destroy_process_group()


def test_overlapped_all_reduce_gives_the_plain_sums():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pt")
        mp.spawn(_combine_worker, args=(free_port(), path), nprocs=2)
        out = torch.load(path)
    assert torch.allclose(out["fused"], out["plain"], atol=1e-5)


def test_placement_defaults_and_errors():
    big = dict(n_heads=60, mlp_hidden=24576)  # characters-57b
    demo = dict(n_heads=get_spec("demo").n_heads, mlp_hidden=get_spec("demo").mlp_hidden)  # 6 heads, MLP 1024
    assert Placement.plan(None, None, visible=0, **big) == Placement()
    assert Placement.plan(None, None, visible=1, **big) == Placement((0,), ())
    assert Placement.plan(None, None, visible=4, **big) == Placement((0, 1, 2), (3,))
    assert Placement.plan("0,1,2,3", "3", visible=8, **big) == Placement((0, 1, 2), (3,))
    assert Placement.plan(None, None, visible=8, n_heads=6, mlp_hidden=1536) == Placement((0, 1, 2, 3, 4, 5), (7, 6))
    assert Placement.plan("0,1,2,3,4,5,6,7", "6,7", visible=8, **big) == Placement((0, 1, 2, 3, 4, 5), (6, 7))
    # a degree must split the MLP evenly too: demo's 1024 columns go 2 ways, not 3 or 6
    assert Placement.plan(None, None, visible=4, **demo) == Placement((0, 1), (3, 2))
    assert Placement.plan(None, None, visible=8, **demo).tp == 2
    with pytest.raises(ValueError, match="3 diffusion GPUs cannot split 6 heads and an MLP width of 1024 evenly; give 1 or 2"):
        Placement.plan("0,1,2,3", "3", visible=4, **demo)
    with pytest.raises(ValueError, match="not visible"):
        Placement.plan("0,1,5", None, visible=4, **big)
    with pytest.raises(ValueError, match="twice"):
        Placement.plan("0,0", None, visible=4, **big)
    with pytest.raises(ValueError, match="cannot split"):
        Placement.plan("0,1,2,3,4,5,6", "6", visible=8, n_heads=8, mlp_hidden=64)
    with pytest.raises(ValueError, match="comma-separated"):
        Placement.plan("zero", None, visible=4, **big)


def test_a_degree_the_spec_cannot_split_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="degree 3 must divide n_heads 6 and mlp_hidden 1024"):
        DistributedEngine(get_spec("demo"), Placement(cpu_ranks=3))


def test_realtime_character_runs_unchanged_on_the_distributed_engine(monkeypatch):
    from engine.audio import SAMPLE_RATE, frame_sample
    from engine.realtime import RealtimeCharacter, RemoteSteps

    t = torch.arange(int(0.6 * SAMPLE_RATE)) / SAMPLE_RATE
    speech = (0.2 * torch.sin(2 * torch.pi * 180 * t)).numpy()
    local = RealtimeCharacter(EngineSession(build_model(SPEC6, seed=0), seed=0), StandInCodec(SPEC6, seed=0))
    local.steps.session.start(reference_latent(SPEC6))
    local.push_audio(speech, SAMPLE_RATE)
    want = [f for _ in range(5) for f in local.make_step()]
    monkeypatch.setattr(DistributedEngine, "TIMINGS_KEPT", 3, raising=False)
    with DistributedEngine(SPEC6, Placement(cpu_ranks=2), timeout=120) as engine:
        steps = RemoteSteps(engine)
        steps.start(reference_latent(SPEC6))
        remote = RealtimeCharacter(steps=steps, lookahead=1)
        remote.push_audio(speech, SAMPLE_RATE)
        got = []
        while len(got) < len(want):
            got += remote.make_step()  # the first call returns nothing: one step in flight
        delivered = [t["delivered"] for t in engine.timings]
    assert len(delivered) == 3 and delivered == sorted(delivered)  # a long session keeps only the latest steps' timings
    assert [f.index for f in got] == list(range(20))
    assert [f.speaking for f in got] == [f.speaking for f in want]
    played = np.concatenate([f.pcm for f in got])
    assert played.size == frame_sample(20) and np.array_equal(played[: speech.size], speech)
    assert any(f.rgb.any() for f in got)
    assert max(abs(a.rgb.astype(int) - b.rgb.astype(int)).max() for a, b in zip(got, want)) <= 1


GPU_SPEC = TINY.with_(name="tiny-gpu", dim=256, n_heads=4, mlp_hidden=512, latent_grid=(8, 8), reference_grid=(8, 8), sink_slots=66)


def gpu_engine_frames(placement: Placement, overlap: bool = False) -> torch.Tensor:
    with DistributedEngine(GPU_SPEC, placement, EngineOptions(fused_allreduce=overlap), timeout=300) as engine:
        engine.start(reference_latent(GPU_SPEC))
        for t in range(STEPS):
            engine.submit_step(torch.randn(4, GPU_SPEC.n_mels, generator=torch.Generator().manual_seed(t)), t * 4)
        got = [engine.next_frames() for _ in range(STEPS)]
    assert [i for i, _ in got] == list(range(STEPS))
    return torch.stack([f for _, f in got]).float()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs two Hopper-class GPUs")
def test_two_gpus_give_the_frames_of_one():
    """bf16 on GPUs: TP2 (plain NCCL, then the fused GEMM + all-reduce) against one GPU, decoder on
    its own GPU. Tolerance: mean |difference| <= 1 level of 255 and no pixel off by more than 12
    (bf16 partial sums rounded in another order, over 7 steps of 4 passes)."""
    one = gpu_engine_frames(Placement((0,), (1,)))
    for overlap in (False, True):
        two = gpu_engine_frames(Placement((0, 1), ()), overlap=overlap)
        diff = (two - one).abs()
        assert diff.mean().item() <= 1.0 and diff.max().item() <= 12, (overlap, diff.mean().item(), diff.max().item())


IPC_CLOSE_SCRIPT = """
from lab.bench import bench_pipeline
from engine.distributed import Placement

if __name__ == "__main__":  # the demo character, its decoder in its own process, two steps in flight at close
    result = bench_pipeline("demo", Placement((0,), ()), steps=8)
    print("closed", result["steps_timed"], flush=True)
"""


@pytest.mark.gpu
def test_closing_with_steps_in_flight_leaves_no_latent_mapped_past_its_owner(tmp_path):
    """On a GPU the decoder process maps rank 0's latents through CUDA IPC. `lab.bench pipeline` closes its
    engine with two steps in flight; with the ranks stopped before the decoders had decoded them, PyTorch
    warned at rank 0's exit that tensors it shared were still held. The engine now lets the decoder finish
    with them first, and the warning must not appear."""
    done = run_script(tmp_path / "ipc_close.py", IPC_CLOSE_SCRIPT, timeout=300)
    assert done.returncode == 0 and "closed" in done.stdout, done.stdout + done.stderr
    assert "Producer process has been terminated" not in done.stderr, done.stderr


def _gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie nobody reaped)."""
    try:
        return "\nState:\tZ" in open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return True


def test_engine_processes_exit_when_the_process_that_started_them_is_killed(tmp_path):
    """A parent killed outright (SIGKILL, the OOM killer) never closes its engine: the workers notice it is gone
    and exit, instead of waiting on their queues for good and holding their GPUs."""
    import json
    import signal

    out = run_script(tmp_path / "killed_parent.py", """
import json, os, signal
from engine.config import get_spec
from engine.distributed import DistributedEngine, Placement
if __name__ == "__main__":
    engine = DistributedEngine(get_spec("tiny"), Placement(cpu_ranks=2))
    print(json.dumps(list(engine.pids().values())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""", timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) >= 3  # two ranks and a decoder
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if not _gone(p)]
    for pid in left:  # do not leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left


def _ignore_sigterm_and_wait(ready) -> None:
    import signal as _signal

    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
    ready.set()
    time.sleep(600)


def test_a_worker_that_ignores_sigterm_is_still_ended():
    from engine.distributed import end_process

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_ignore_sigterm_and_wait, args=(ready,), daemon=True)
    p.start()
    assert ready.wait(60)  # its handler set
    end_process(p, wait_s=1.0)
    assert not p.is_alive() and p.exitcode == -9


def test_workers_left_idle_with_their_parent_alive_stay_and_still_step():
    """Idle for a few of the workers' parent checks (a spare engine waits for its session; a decoder waits while
    the ranks load and compile), the engine is whole and steps."""
    from engine.distributed import PARENT_POLL_S

    with DistributedEngine(TINY, Placement(cpu_ranks=1), timeout=120) as engine:
        time.sleep(3 * PARENT_POLL_S)
        assert engine.alive()
        engine.start(reference_latent(TINY))
        engine.submit_step(torch.zeros(4, TINY.n_mels), 0)
        index, frames = engine.next_frames()
    assert index == 0 and frames.shape[0] == TINY.frames_per_latent


def test_a_decoder_process_gets_the_rows_the_local_decoder_gets(tmp_path):
    """An audio-conditioned codec (random audio layers, so that the rows show in the frames) decodes in its own
    process from the rows the local path cuts, whether the step's window comes with it (as RealtimeCharacter
    sends it) or was pushed before (the session's own window)."""
    from engine.checkpoint import save_checkpoint
    from engine.codec import build_codec, codec_config, decode_step, save_codec
    from engine.weights import load_engine

    save_checkpoint(build_model(SPEC6, seed=0), SPEC6, tmp_path / "tiny6.pt")
    codec = build_codec(SPEC6, seed=1, cfg=codec_config(SPEC6, audio=True, audio_context=0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for film in codec.decoder.film:
            film.proj.weight.copy_(0.5 * torch.randn(film.proj.weight.shape, generator=g))
    save_codec(codec, tmp_path / "tiny6-codec.pt")
    model, codec, trained = load_engine(SPEC6, weights=tmp_path / "tiny6.pt")
    assert trained and codec.audio_mels == SPEC6.n_mels
    ctx = SPEC6.audio_context

    def window(t: int) -> torch.Tensor:
        return torch.randn(SPEC6.audio_window, SPEC6.n_mels, generator=torch.Generator().manual_seed(100 + t))

    session, pushed = EngineSession(model, seed=0), EngineSession(model, seed=0)
    session.start(reference_latent(SPEC6))
    pushed.start(reference_latent(SPEC6))
    local, local_pushed, wrong = [], [], []
    for t in range(STEPS):
        latent = session.step(window(t))
        local.append(decode_step(codec, latent, window(t), SPEC6))
        wrong.append(decode_step(codec, latent, window(t + 1), SPEC6))
        pushed.push_audio_features(features(t), t * 4)
        rows = pushed._audio_window().clone()
        local_pushed.append(decode_step(codec, pushed.step(), rows, SPEC6))
    with DistributedEngine(SPEC6, Placement(cpu_ranks=1), EngineOptions(weights=str(tmp_path / "tiny6.pt")),
                           timeout=120) as engine:
        engine.start(reference_latent(SPEC6))
        for t in range(STEPS):
            engine.submit_step(window(t), 4 * t - ctx)
        remote = torch.stack([engine.next_frames()[1] for _ in range(STEPS)])
    with DistributedEngine(SPEC6, Placement(cpu_ranks=1), EngineOptions(weights=str(tmp_path / "tiny6.pt")),
                           timeout=120) as engine:
        _, remote_pushed = engine_frames(engine)
    local, local_pushed, wrong = torch.stack(local), torch.stack(local_pushed), torch.stack(wrong)
    assert (remote.int() - local.int()).abs().max().item() <= 1
    assert (remote_pushed.int() - local_pushed.int()).abs().max().item() <= 1
    assert (wrong.int() - local.int()).abs().max().item() > 8  # other rows show: the comparison has teeth
