"""Triton kernels against their PyTorch references (interpreter on CPU, hardware on GPU).

Tolerances: cache writes, the sink and the reset rotation equal the PyTorch path
except for rare one-step e4m3 rounding differences (fused multiply-adds); FP8
attention is within 3% (relative L2) of exact attention over the same FP8 cache (the
probabilities are rounded to e4m3 too); FP8 linears within 5% of the float product.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from engine import fp8  # noqa: E402
from engine.cache import RingKVCache  # noqa: E402
from engine.kernels.fp8_attention import FP8Attention, _exp2_fma, attention_reference, qk_scale  # noqa: E402
from engine.kernels.fp8_linear import FP8Linear, quantize_rows, quantize_rows_reference  # noqa: E402
from tests.helpers import (TINY, assert_e4m3_output_is_bf16_output_rounded, assert_e4m3_output_never_saturates,  # noqa: E402
                           rms_heads, run_session, v_scale_worst_case)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The GPU's tensor cores need head_dim >= 16 and real tile sizes; the interpreter runs anything.
SPEC = TINY if DEVICE.type == "cpu" else TINY.with_(dim=256, n_heads=4, latent_grid=(8, 8), reference_grid=(8, 8), sink_slots=66)


def close_fp8(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> None:
    """Equal but for rare single-step rounding differences."""
    da, db = a.float(), b.float()
    step = fp8.relative_step(torch.maximum(da.abs(), db.abs()))
    assert ((da - db).abs() <= step * 1.001).all()
    assert (da == db).float().mean() > 0.99


def make_caches(gains):
    kw = dict(q_gains=gains, kv_dtype="fp8", reset_every=5, device=DEVICE)
    return RingKVCache(SPEC, gains, gains, backend="torch", **kw), RingKVCache(SPEC, gains, gains, backend="triton", **kw)


def test_frame_write_sink_and_reset_rotation_match_pytorch():
    g = torch.Generator().manual_seed(0)
    H, D, F = SPEC.n_heads, SPEC.head_dim, SPEC.frame_tokens
    gains = [(torch.rand(H, D, generator=g) + 0.5).to(DEVICE) for _ in range(SPEC.n_blocks)]
    ref, fast = make_caches(gains)
    sink = [rms_heads(g, H, SPEC.reference_tokens, D).to(DEVICE) for _ in range(SPEC.n_blocks)]
    for c in (ref, fast):
        for layer in range(SPEC.n_blocks):
            c.reference_attend(layer, sink[layer], sink[layer], sink[layer])
    for step in range(7):  # crosses the reset at step 5
        frame = [rms_heads(g, H, F, D).to(DEVICE) * gains[0].unsqueeze(1) for _ in range(3)]
        for c in (ref, fast):
            c.begin_step(step)
        for layer in range(SPEC.n_blocks):
            ref.write(layer, frame[1], frame[2])
            fast._attend_triton(layer, frame[0], frame[1], frame[2])
        close_fp8(fast.k, ref.k, ref.k_scale)
        close_fp8(fast.vt_in_slot_order(), ref.vt, ref.v_scale)
        assert torch.equal(fast.valid, ref.valid)
    assert fast.resets == ref.resets == 1
    # q was rotated and quantised as the PyTorch path does
    cos, sin = ref._frame_cos_sin()
    from engine.rope import apply_rope

    close_fp8(fast.q8, fp8.quantize(apply_rope(frame[0], cos, sin), fast.q_scale[-1]), fast.q_scale[-1])


def test_v_slots_are_stored_where_the_attention_kernel_reads_them(monkeypatch):
    """For a kernel that reads V's slots reordered (the warp-specialised one), the cache writes each slot's V
    where that kernel reads it (the sink in PyTorch, frames in the write kernel) and reads them back in slot
    order. The Triton kernel stands in for the reordering one here, so this runs on the CPU too."""
    pytest.importorskip("triton.experimental.gluon")
    from engine.kernels.fp8_attention_ws import pv_slot_order

    g = torch.Generator().manual_seed(3)
    H, D, F, L = SPEC.n_heads, SPEC.head_dim, SPEC.frame_tokens, SPEC.n_blocks
    gains = [(torch.rand(H, D, generator=g) + 0.5).to(DEVICE) for _ in range(L)]
    kw = dict(q_gains=gains, kv_dtype="fp8", reset_every=5, device=DEVICE, backend="triton", attention_options={"kernel": "triton"})
    plain = RingKVCache(SPEC, gains, gains, **kw)
    monkeypatch.setattr(FP8Attention, "permutes_v_slots", True)
    moved = RingKVCache(SPEC, gains, gains, **kw)
    assert plain.v_positions is None and moved.v_positions is not None
    sink = [rms_heads(g, H, SPEC.reference_tokens, D).to(DEVICE) for _ in range(L)]
    for step in range(2):
        frame = [rms_heads(g, H, F, D).to(DEVICE) for _ in range(3)]
        for c in (plain, moved):
            if step == 0:
                for layer in range(L):
                    c.reference_attend(layer, sink[layer], sink[layer], sink[layer])
            c.begin_step(step)
            for layer in range(L):
                c._attend_triton(layer, *frame)
    order = pv_slot_order(plain.vt.shape[-1], DEVICE)
    assert torch.equal(moved.vt.view(torch.uint8), plain.vt[..., order].view(torch.uint8))  # column j: slot order[j]
    assert not torch.equal(moved.vt.view(torch.uint8), plain.vt.view(torch.uint8))
    assert torch.equal(moved.vt_in_slot_order().view(torch.uint8), plain.vt.view(torch.uint8))
    for a, b in zip(moved.read(1, torch.float32), plain.read(1, torch.float32)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("splits, exp2, lazy, S, tma, pv_fp8", [
    (1, "mufu", False, 300, False, True), (3, "mufu", False, 300, False, True), (1, "fma", False, 300, False, True),
    (1, "fma", True, 300, False, True), (3, "mufu", True, 300, False, True), (1, "mixed", False, 300, False, True),
    (1, "mixed", False, 512, False, True), (2, "mufu", False, 512, False, True), (1, "mufu", False, 512, True, True),
    (2, "mixed", True, 512, True, True), (1, "mufu", False, 300, False, False), (1, "mufu", False, 512, True, False)])
def test_fp8_attention_matches_exact_attention_over_the_same_cache(splits, exp2, lazy, S, tma, pv_fp8):
    """S = 512 is a whole number of blocks (and of splits x blocks): the kernel's loop runs without bounds masks,
    and the K and V tiles may come through tensor descriptors (TMA). pv_fp8=False: P x V in fp16."""
    g = torch.Generator().manual_seed(1)
    H, M, D = 2, 70, SPEC.head_dim if DEVICE.type == "cpu" else 128
    scale = fp8.per_head_scale(torch.ones(H, D)).to(DEVICE)
    q8 = fp8.quantize(rms_heads(g, H, M, D).to(DEVICE), scale)
    k8 = fp8.quantize(rms_heads(g, H, S, D).to(DEVICE), scale)
    vt8 = fp8.quantize(rms_heads(g, H, S, D).to(DEVICE), scale).transpose(1, 2).contiguous()
    valid = torch.ones(S, dtype=torch.int8, device=DEVICE)
    valid[40:130] = 0  # empty ring slots
    out = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    blocks = dict(block_m=16, block_n=16) if DEVICE.type == "cpu" else {}
    attention = FP8Attention(H, M, S, D, DEVICE, splits=splits, exp2=exp2, lazy_rescale=lazy, tma=tma, pv_fp8=pv_fp8,
                             **blocks)
    assert attention.even_n == (S % (splits * attention.block_n) == 0)
    attention(q8, k8, vt8, valid, qk_scale(scale, scale, D), scale, out)
    ref = attention_reference(q8, k8, vt8, valid, scale, scale, scale)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 3e-2


def test_fp8_attention_refuses_tma_when_tiles_would_cross_heads():
    with pytest.raises(ValueError, match=r"tma needs the slots \(300\) to be a whole number of splits x block_n \(1 x 64\)"):
        FP8Attention(2, 70, 300, 64, DEVICE, block_n=64, tma=True)


@pytest.mark.parametrize("lazy", [False, True])
def test_fp8_attention_follows_a_row_maximum_that_keeps_rising(lazy):
    """Scores that rise by about 0.75 (log2 units) from one block of slots to the next: the lazy
    rescale must rescale at every block (past its 0.5 threshold) or the e4m3 probabilities saturate."""
    H, M, S = 1, 16, 256
    D = SPEC.head_dim if DEVICE.type == "cpu" else 128
    block_n = 16 if DEVICE.type == "cpu" else 64
    rise = 0.75 * S / block_n  # log2 units over the whole row
    q = torch.zeros(H, M, D)
    q[..., 0] = 1.0
    k = torch.zeros(H, S, D)
    k[0, :, 0] = torch.linspace(0, rise, S) * D ** 0.5 / 1.4426950408889634
    v = torch.randn(H, S, D, generator=torch.Generator().manual_seed(3))
    scale = lambda x: (x.abs().amax(dim=(1, 2)).clamp_min(1e-6) / fp8.FP8_MAX)
    qs, ks, vs = scale(q), scale(k), scale(v)
    q8, k8 = fp8.quantize(q, qs).to(DEVICE), fp8.quantize(k, ks).to(DEVICE)
    vt8 = fp8.quantize(v, vs).transpose(1, 2).contiguous().to(DEVICE)
    qs, ks, vs = qs.to(DEVICE), ks.to(DEVICE), vs.to(DEVICE)
    valid = torch.ones(S, dtype=torch.int8, device=DEVICE)
    out = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    blocks = dict(block_m=16, block_n=block_n) if DEVICE.type == "cpu" else dict(block_n=block_n)
    FP8Attention(H, M, S, D, DEVICE, lazy_rescale=lazy, **blocks)(q8, k8, vt8, valid, qk_scale(qs, ks, D), vs, out)
    ref = attention_reference(q8, k8, vt8, valid, qs, ks, vs)
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 3e-2


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_attention_writes_e4m3_output_at_a_scale_that_never_saturates(splits):
    """With an e4m3 `out` and V's scales divided by `out_scale`, the kernel writes what it writes in bf16,
    rounded to e4m3. V at e4m3's largest value is the scale's worst case: those outputs must stay below
    448 (a scale without the headroom for P's rounding saturates them at 448)."""
    g = torch.Generator().manual_seed(4)
    H, M, S, D = 3, 70, 300, SPEC.head_dim if DEVICE.type == "cpu" else 128
    scale, vt8 = v_scale_worst_case(g, H, S, D, DEVICE)
    q8 = fp8.quantize(rms_heads(g, H, M, D).to(DEVICE), scale)
    k8 = fp8.quantize(rms_heads(g, H, S, D).to(DEVICE), scale)
    valid = torch.ones(S, dtype=torch.int8, device=DEVICE)
    valid[40:130] = 0
    blocks = dict(block_m=16, block_n=16) if DEVICE.type == "cpu" else {}
    attention = FP8Attention(H, M, S, D, DEVICE, splits=splits, **blocks)
    out16 = assert_e4m3_output_never_saturates(attention, q8, k8, vt8, valid, scale, S)
    with pytest.raises(ValueError, match="out must be bf16 or float8_e4m3fn"):
        attention(q8, k8, vt8, valid, qk_scale(scale, scale, D), scale, out16.float())


@triton.jit
def _exp2_fma_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, _exp2_fma(tl.load(x + i, mask=i < n, other=0.0)), mask=i < n)


def test_exp2_on_the_fma_units_is_within_its_stated_error():
    """The softmax's 2^x without the special-function unit: relative error < 0.2% over the range the
    kernel feeds it (x <= 0), exactly 0 at -inf."""
    x = torch.cat([-torch.linspace(0, 120, 4000), torch.tensor([float("-inf"), -0.0, -1e-7, -0.5, -0.4999])]).to(DEVICE)
    y = torch.empty_like(x)
    _exp2_fma_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = torch.exp2(x.double())
    finite = torch.isfinite(x)
    assert ((y[finite].double() - want[finite]).abs() / want[finite]).max().item() < 2e-3
    assert y[~finite].eq(0).all()


def test_static_gemm_schedule_is_asked_for_unless_the_user_set_the_workspace(monkeypatch):
    from engine.kernels.fp8_linear import GEMM_WORKSPACE_ENV, prefer_static_gemm_schedule

    monkeypatch.delenv(GEMM_WORKSPACE_ENV, raising=False)
    assert prefer_static_gemm_schedule() and os.environ[GEMM_WORKSPACE_ENV] == "0"
    monkeypatch.setenv(GEMM_WORKSPACE_ENV, "4096")
    assert not prefer_static_gemm_schedule() and os.environ[GEMM_WORKSPACE_ENV] == "4096"


def test_row_quantisation_matches_reference():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(37, 96, generator=g) * torch.rand(37, 1, generator=g) * 10).to(DEVICE)
    x8, sx = quantize_rows(x)
    r8, rs = quantize_rows_reference(x)
    assert torch.allclose(sx, rs)
    close_fp8(x8, r8, rs)


def test_fp8_linear_is_close_to_the_float_product():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(256, 192, bias=False).to(DEVICE)
    x = torch.randn(45, 256, generator=g).to(DEVICE)
    exact = lin(x)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    y = FP8Linear(lin.to(dtype))(x.to(dtype)).float()
    assert ((y - exact).norm() / exact.norm()).item() <= 5e-2


def _model():
    from engine.model import build_model

    return build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)


def test_triton_session_tracks_the_pytorch_fp8_session():
    model = _model()
    blocks = dict(block_m=16, block_n=16) if DEVICE.type == "cpu" else {}
    ring = run_session(model, 8, cache="ring", kv_dtype="fp8", backend="torch")
    fast = run_session(model, 8, cache="ring", kv_dtype="fp8", backend="triton", attention_options=dict(kernel="triton", splits=2, **blocks))
    rel = ((fast.float() - ring.float()).norm() / ring.float().norm()).item()
    assert rel <= 2e-2


def test_ring_answers_fp8_out_in_e4m3_rounded_from_its_bf16_output():
    """attend(fp8_out=True) on the triton backend: e4m3 rows and their (per-layer) scale, the rounding of the
    (H, N, D) bf16 output that attend gives without fp8_out."""
    from engine.kernels.fp8_attention import out_scale

    g = torch.Generator().manual_seed(5)
    H, D, F = SPEC.n_heads, SPEC.head_dim, SPEC.frame_tokens
    gains = [(torch.rand(H, D, generator=g) + 0.5).to(DEVICE) for _ in range(SPEC.n_blocks)]
    _, fast = make_caches(gains)
    for layer in range(SPEC.n_blocks):
        sink = rms_heads(g, H, SPEC.reference_tokens, D).to(DEVICE)
        fast.reference_attend(layer, sink, sink, sink)
    fast.begin_step(0)
    frame = [rms_heads(g, H, F, D).to(DEVICE) for _ in range(3)]
    o8, rows_scale = fast.attend(1, *frame, fp8_out=True)
    assert o8.dtype == fp8.FP8 and o8.shape == (F, H * D) and rows_scale.shape == (F, 1)
    assert torch.equal(rows_scale, out_scale(fast.v_scale[1], fast.k.shape[2]).expand(F, 1))
    o16 = fast.attend(1, *frame)
    assert o16.shape == (H, F, D)
    assert_e4m3_output_is_bf16_output_rounded(o8, o16.transpose(0, 1).reshape(F, H * D), rows_scale[0])


def test_fused_fp8_blocks_read_the_ring_kernels_e4m3_attention_output(monkeypatch):
    """The serving block asks the ring for its attention output in e4m3 (no quantisation pass before the
    out-projection); the torch backend answers in bf16 and the block quantises it. Both sessions agree."""
    import copy

    from engine.cache import RingKVCache
    from engine.kernels.fp8_linear import quantize_linears_

    from engine.model import build_model

    model = quantize_linears_(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16), fuse=True)  # as served
    blocks = dict(block_m=16, block_n=16) if DEVICE.type == "cpu" else {}
    kw = dict(cache="ring", kv_dtype="fp8")
    answers = []
    attend_triton = RingKVCache._attend_triton

    def spy(self, *args, **kwargs):
        result = attend_triton(self, *args, **kwargs)
        answers.append(isinstance(result, tuple) and result[0].dtype == fp8.FP8)
        return result

    monkeypatch.setattr(RingKVCache, "_attend_triton", spy)
    ring = run_session(copy.deepcopy(model), 3, backend="torch", **kw)
    fast = run_session(model, 3, backend="triton", attention_options=dict(kernel="triton", **blocks), **kw)
    assert answers and all(answers)
    rel = ((fast.float() - ring.float()).norm() / ring.float().norm()).item()
    assert rel <= 2e-2


@pytest.mark.parametrize("cache", ["reference", "ring-torch", "ring-triton"])
def test_a_float32_model_served_with_fused_fp8_linears_runs_on_every_cache(cache):
    """FP8 linears give bf16 q, k, v while a float32 model's rotation tables are float32: every cache keeps the
    rotated q and k in the projection's dtype (attention takes one dtype) and the session agrees with the same
    weights served in bf16."""
    import copy

    from engine.kernels.fp8_linear import quantize_linears_
    from engine.model import build_model

    kw = {"reference": dict(cache="reference"), "ring-torch": dict(cache="ring", kv_dtype="fp8", backend="torch"),
          "ring-triton": dict(cache="ring", kv_dtype="fp8", backend="triton",
                              attention_options=dict(kernel="triton", block_m=16, block_n=16) if DEVICE.type == "cpu" else None)}[cache]
    float32 = quantize_linears_(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.float32), fuse=True)
    bf16 = quantize_linears_(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16), fuse=True)
    out = run_session(copy.deepcopy(float32), 2, **kw)
    served = run_session(bf16, 2, **kw)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = ((out.float() - served.float()).norm() / served.float().norm()).item()
    assert rel <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
@pytest.mark.parametrize("p_options, tolerance", [({}, 3e-2), ({"exp2": "mufu", "row_sum": "fma"}, 2e-2)])
def test_warp_specialized_attention_session_tracks_the_pytorch_fp8_session(p_options, tolerance):
    """As served (P as log-linear e4m3 codes, row sums on the tensor cores): within 3% of the PyTorch FP8 session
    after 8 steps; with P the e4m3 value nearest 2^x and FP32 row sums, within 2%."""
    model = _model()
    ring = run_session(model, 8, cache="ring", kv_dtype="fp8", backend="torch")
    fast = run_session(model, 8, cache="ring", kv_dtype="fp8", backend="triton", attention_options=dict(kernel="ws", **p_options))
    rel = ((fast.float() - ring.float()).norm() / ring.float().norm()).item()
    assert rel <= tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
def test_the_ring_serves_the_warp_specialised_kernel_s_served_options_changed_only_where_told():
    from engine.kernels.fp8_attention_ws import SERVED_OPTIONS

    g = torch.Generator().manual_seed(0)
    gains = [(torch.rand(SPEC.n_heads, SPEC.head_dim, generator=g) + 0.5).to(DEVICE) for _ in range(SPEC.n_blocks)]
    kw = dict(q_gains=gains, kv_dtype="fp8", reset_every=5, device=DEVICE, backend="triton")
    served = RingKVCache(SPEC, gains, gains, **kw)
    assert served.attention_kernel == "ws" and served.attention_options == SERVED_OPTIONS
    assert (served.attention.exp2, served.attention.row_sum, served.attention.block_m) == ("e4m3_bits", "tensor", 128)
    told = RingKVCache(SPEC, gains, gains, attention_options={"kernel": "ws", "stages": 3}, **kw)  # one setting changed
    assert told.attention_options == {**SERVED_OPTIONS, "stages": 3}
    assert (told.attention.exp2, told.attention.block_m, told.attention.stages) == ("e4m3_bits", 128, 3)


@pytest.mark.gpu
def test_sink_store_and_reset_rotation_reach_rows_past_two_billion_elements():
    """The sink store and the reset rotation address every layer's rows of the cache at once, past 2^31
    elements at tensor-parallel degree 1 (60 layers x 60 heads x 5,824 slots x 128). The last row of a
    (3, 2^23 + 64, 128) cache starts past 2^31: both kernels must give it what they give the same row alone."""
    from engine.kernels.rope_write import delta_rotate, rope_store

    if torch.cuda.mem_get_info()[0] < 5 * 2**30:
        pytest.skip("needs 5 GB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    R, S, D, N, P = 3, 2**23 + 64, 128, 32, 4
    assert (R - 1) * S * D > 2**31
    big = torch.zeros(R, S, D, device="cuda", dtype=fp8.FP8)
    small = torch.zeros(R, 2 * N, D, device="cuda", dtype=fp8.FP8)
    src = torch.randn(R, N, D, generator=g, device="cuda")
    scale = src.abs().amax((1, 2)) / 400.0
    cos, sin = torch.randn(2, 1, N, D // 2, generator=g, device="cuda").unbind(0)
    pos_idx = torch.zeros(1, device="cuda", dtype=torch.int32)
    for dst in (big, small):  # the sink rows, then the last N slots rotated by the reset's temporal angles
        rope_store(src, cos, sin, pos_idx, dst, scale)
        dst[:, -N:] = dst[:, :N]
        delta_rotate(dst, torch.full((P,), 0.6, device="cuda"), torch.full((P,), 0.8, device="cuda"), scale, dst.shape[1] - N)
    torch.cuda.synchronize()
    assert torch.equal(big[:, :N].view(torch.uint8), small[:, :N].view(torch.uint8))
    assert torch.equal(big[:, -N:].view(torch.uint8), small[:, -N:].view(torch.uint8))
    assert not torch.equal(big[2, -N:].view(torch.uint8), big[2, :N].view(torch.uint8))  # the rotation moved them
    assert not big[:, N:-N].view(torch.uint8).any()  # and nothing between was written


def test_attention_options_name_their_kernel():
    with pytest.raises(ValueError, match="need the kernel they are for"):
        run_session(_model(), 1, cache="ring", kv_dtype="fp8", backend="triton", attention_options=dict(splits=2))


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps():
    model = _model()
    eager = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton")
    graph = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    assert torch.equal(eager, graph)


@pytest.mark.gpu
def test_the_graph_times_itself_from_inside():
    """The marks recorded inside the step's graph: once captured and uploaded (the first step), it starts within a
    millisecond of its inputs being copied in, and its own GPU time lies within the step's wall time."""
    import time

    from engine.session import EngineSession
    from tests.helpers import reference_latent

    model = _model()
    session = EngineSession(model, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    session.start(reference_latent(model.spec).to(DEVICE, torch.bfloat16))
    audio = torch.zeros(model.spec.frames_per_latent, model.spec.n_mels, device=DEVICE)
    assert session.last_graph_times() is None
    for step in range(3):
        session.push_audio_features(audio)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        session.step()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
        marks = session.last_graph_times()
        assert 0 <= marks["launch_lag_ms"] < (wall_ms if step == 0 else 1.0)
        assert 0 < marks["graph_ms"] <= wall_ms


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps_with_fp8_linears_and_branch_streams():
    """The serving configuration: fused FP8 blocks with the MLP branch on a side stream, captured in the step's graph."""
    from engine.kernels.fp8_linear import quantize_linears_

    model = quantize_linears_(_model(), fuse=True, branch_streams=True)
    assert model.blocks[0].branch_streams
    eager = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton")
    graph = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    assert torch.equal(eager, graph)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
def test_block_linears_on_the_triton_gemm_track_cublas_through_a_session():
    """As served on Hopper where the outputs tile (this spec's do): all four block linears on the Triton FP8 GEMM, the
    out-projection reading the attention's e4m3 output; against the same weights with every product on cuBLAS."""
    import copy

    from engine.kernels.fp8_linear import BLOCK_LINEARS, quantize_linears_

    model = _model()
    served = quantize_linears_(copy.deepcopy(model), fuse=True, fast_accum=True)
    assert {getattr(served.blocks[0], n).gemm_kernel for n in BLOCK_LINEARS} == {"triton"}
    cublas = quantize_linears_(model, fuse=True, fast_accum=True, gemm_kernels=dict.fromkeys(BLOCK_LINEARS, "cublas"))
    kw = dict(cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    fast, slow = run_session(served, 8, **kw), run_session(cublas, 8, **kw)
    rel = ((fast.float() - slow.float()).norm() / slow.float().norm()).item()
    assert rel <= 1e-2, rel


def test_programmatic_dependent_launch_is_off_without_a_gpu_or_when_turned_off(monkeypatch):
    """PDL needs sm_90 and a CUDA launch: never on the CPU or under the interpreter; set_pdl and TALKLOOP_PDL=0 turn it off."""
    from engine.kernels import PDL_ENV, launch_pdl, pdl_launch, set_pdl

    assert pdl_launch(torch.device("cpu")) == (False, {})
    monkeypatch.setenv(PDL_ENV, "0")
    assert not launch_pdl(DEVICE)
    monkeypatch.delenv(PDL_ENV)
    try:
        set_pdl(False)
        assert not launch_pdl(DEVICE)
    finally:
        set_pdl(None)


@pytest.mark.gpu
def test_programmatic_dependent_launch_changes_no_step_eager_or_in_the_graph():
    """The serving configuration with and without PDL (the kernels that take it wait for the one before): the same
    latents bit for bit, eagerly and replayed from the step's graph, and launched with it where this GPU and Triton can."""
    from engine.kernels import launch_pdl, set_pdl
    from engine.kernels.fp8_linear import quantize_linears_

    model = quantize_linears_(_model(), fuse=True, branch_streams=True)
    runs = {}
    try:
        for pdl in (False, True):
            set_pdl(pdl)
            assert launch_pdl(DEVICE) == (pdl and torch.cuda.get_device_capability(DEVICE)[0] >= 9)
            runs[pdl] = [run_session(model, 8, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=graph)
                         for graph in (False, True)]
    finally:
        set_pdl(None)
    for without, with_pdl in zip(runs[False], runs[True]):
        assert torch.equal(without, with_pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [False, True])
def test_scaled_mm_path_matches_the_dequantised_reference(fast_accum):
    """Fast accumulation too, at the 57b rank's longest reduction (K = 8192): within 1% of the float32 sums."""
    for k in (512, 8192):
        lin = torch.nn.Linear(k, 384, bias=False).to(DEVICE, torch.bfloat16)
        x = torch.randn(757, k, device=DEVICE, dtype=torch.bfloat16)
        fast, ref = FP8Linear(lin, fast_accum=fast_accum), FP8Linear(lin, use_scaled_mm=False)
        assert fast.use_scaled_mm
        a, b = fast(x).float(), ref(x).float()
        assert ((a - b).norm() / b.norm()).item() <= 1e-2


# Fused block kernels ---------------------------------------------------------------


def test_ln_modulate_quant_matches_float_reference():
    from engine.kernels.fused_block import ln_modulate_quant
    from engine.model import modulate

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(33, 96, generator=g) * 3 + 1).to(DEVICE)
    shift, scale = torch.randn(96, generator=g).to(DEVICE), torch.randn(96, generator=g).to(DEVICE) * 0.3
    h8, sh = ln_modulate_quant(x, shift, scale)
    ref = modulate(torch.nn.functional.layer_norm(x.float(), (96,), eps=1e-6), shift, scale)
    r8, rs = quantize_rows_reference(ref)
    assert torch.allclose(sh, rs, rtol=1e-5)
    close_fp8(h8, r8, rs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frame_write_applies_the_head_norms_it_is_given(dtype):
    """Raw q, k, v (views of one QKV output) with their norm gains land in the cache as the normed ones do
    (in bf16 too: the kernel rounds the normed values to the input's type, as the model's norm does)."""
    from engine.model import apply_head_norm
    from engine.rope import apply_rope

    g = torch.Generator().manual_seed(5)
    H, D, F, L = SPEC.n_heads, SPEC.head_dim, SPEC.frame_tokens, SPEC.n_blocks
    gains = (torch.rand(3, H, D, generator=g) + 0.5).to(DEVICE)
    kw = dict(q_gains=[gains[0]] * L, kv_dtype="fp8", reset_every=5, device=DEVICE)
    ref, fast = (RingKVCache(SPEC, [gains[1]] * L, [gains[2]] * L, backend=b, **kw) for b in ("torch", "triton"))
    for c in (ref, fast):
        c.begin_step(0)
    qkv = (torch.randn(F, 3 * H * D, generator=g) * 3 + 0.5).to(DEVICE, dtype)
    raw = qkv.view(F, 3, H, D).permute(1, 2, 0, 3).unbind(0)  # strided (H, F, D) views, as the fused block passes them
    gains = gains.to(dtype)
    fast._attend_triton(0, *raw, head_norm=(gains, 1e-6))
    q, k, v = (x.float() for x in apply_head_norm(*raw, (gains, 1e-6)))  # normed in the input's type, rotated in float32
    ref.write(0, k, v)
    close_fp8(fast.k[0], ref.k[0], ref.k_scale[0])
    close_fp8(fast.vt_in_slot_order()[0], ref.vt[0], ref.v_scale[0])
    close_fp8(fast.q8, fp8.quantize(apply_rope(q, *ref._frame_cos_sin()), fast.q_scale[0]), fast.q_scale[0])
    # the norms did something: the raw keys quantise differently
    assert not torch.equal(fast.k[0], fp8.quantize(apply_rope(raw[1].float(), *ref._frame_cos_sin()), fast.k_scale[0]))


def test_swiglu_quant_and_gated_sum_match_float_reference():
    from engine.kernels.fused_block import gated_sum, swiglu_quant

    g = torch.Generator().manual_seed(6)
    gu = torch.randn(29, 2 * 80, generator=g).to(DEVICE)
    m8, sm = swiglu_quant(gu)
    gate, up = gu.chunk(2, dim=-1)
    r8, rs = quantize_rows_reference(torch.nn.functional.silu(gate) * up)
    assert torch.allclose(sm, rs, rtol=1e-5)
    close_fp8(m8, r8, rs)
    a, m, x = (torch.randn(29, 2100, generator=g).to(DEVICE) for _ in range(3))
    ga, gm = torch.randn(2100, generator=g).to(DEVICE), torch.randn(2100, generator=g).to(DEVICE)
    assert torch.allclose(gated_sum(a, m, ga, gm), ga * a + gm * m, atol=1e-5)
    assert torch.allclose(gated_sum(a, m, ga, gm, x), x + ga * a + gm * m, atol=1e-5)


def test_gated_sum_ln_quant_equals_the_two_kernels_it_replaces():
    from engine.kernels.fused_block import gated_sum, gated_sum_ln_quant, ln_modulate_quant

    g = torch.Generator().manual_seed(9)
    a, m, x = (torch.randn(29, 2100, generator=g).to(DEVICE) for _ in range(3))
    ga, gm, shift = (torch.randn(2100, generator=g).to(DEVICE) for _ in range(3))
    scale = torch.randn(2100, generator=g).to(DEVICE) * 0.3
    y, h8, sh = gated_sum_ln_quant(a, m, ga, gm, x, shift, scale)
    y_ref = gated_sum(a, m, ga, gm, x)
    h_ref, s_ref = ln_modulate_quant(y_ref, shift, scale)
    assert torch.allclose(y, y_ref, atol=1e-5)
    assert torch.allclose(sh, s_ref, rtol=1e-5)
    close_fp8(h8, h_ref, s_ref)


def test_a_fused_block_hands_the_next_block_its_input():
    from engine.kernels.fp8_linear import quantize_linears_

    model = quantize_linears_(_model(), fuse=True)
    shared, _ = model.blocks[0].fused_pass
    g = torch.Generator().manual_seed(10)
    x = torch.randn(SPEC.frame_tokens, SPEC.dim, generator=g).to(DEVICE, next(model.parameters()).dtype)
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    from engine.cache import attention
    from engine.model import apply_head_norm

    attend = lambda q, k, v, head_norm=None, fp8_out=False: attention(*apply_head_norm(q, k, v, head_norm))
    with torch.no_grad():
        y0 = model.blocks[0](x, mod, attend)
        assert shared._handover is not None and shared._handover[0] is y0
        assert shared.take_over(y0.clone(), mod, 1) is None and shared._handover is None  # another tensor: not taken
        y1_own = model.blocks[1](y0, mod, attend)  # normalises its input itself
        model.blocks[0](x, mod, attend)
        y0_again = shared._handover[0]
        assert torch.equal(y0_again, y0)
        y1_handed = model.blocks[1](y0_again, mod, attend)
    assert shared._handover is None or shared._handover[0] is not y0_again  # taken once
    with torch.no_grad():  # only the block it was made for takes it, and only under an unchanged mod
        model.blocks[0](x, mod, attend)
        assert shared.take_over(shared._handover[0], mod, 0) is None
        y0_again = model.blocks[0](x, mod, attend)
        mod.mul_(1.0)
        assert shared.take_over(y0_again, mod, 1) is None
    with torch.inference_mode():  # inference tensors keep no version: nothing is reused, nothing fails
        xi, modi = x.clone(), mod.clone()
        yi = model.blocks[1](model.blocks[0](xi, modi, attend), modi, attend)
    assert ((yi.float() - y1_own.float()).norm() / y1_own.float().norm()).item() <= 1e-3
    assert ((y1_handed.float() - y1_own.float()).norm() / y1_own.float().norm()).item() <= 1e-3
    # no reference cycle through the shared state: a dropped model goes at once, not at the next gc
    import weakref

    gone = weakref.ref(model)
    del model, shared
    assert gone() is None


def test_fused_block_tracks_the_plain_block():
    import copy

    from engine.kernels.fp8_linear import quantize_linears_

    model = _model()
    plain = quantize_linears_(copy.deepcopy(model), fuse=False)
    fused = quantize_linears_(copy.deepcopy(model), fuse=True)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SPEC.frame_tokens, SPEC.dim, generator=g).to(DEVICE, next(model.parameters()).dtype)
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    from engine.cache import attention
    from engine.model import apply_head_norm

    attend = lambda q, k, v, head_norm=None, fp8_out=False: attention(*apply_head_norm(q, k, v, head_norm))
    with torch.no_grad():
        want = plain.blocks[0](x, mod, attend).float()
        got = fused.blocks[0](x, mod, attend).float()
    assert ((got - want).norm() / want.norm()).item() <= 2e-2
    assert fused.blocks[0].fused_forward is not None and plain.blocks[0].fused_forward is None
    # the stacked norm gains are made once and follow in-place changes of the gains
    from engine.kernels.fused_block import stacked_gains

    block = fused.blocks[0]
    assert stacked_gains(block) is stacked_gains(block)
    with torch.no_grad():
        block.k_norm.weight.mul_(2)
    assert torch.equal(stacked_gains(block)[1], block.k_norm.weight)


def test_modulation_tables_are_made_once_a_pass_and_follow_changes():
    from engine.kernels.fused_block import FusedPass

    model = _model()
    tables = FusedPass(model.blocks).modulation
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    first = tables(0, mod)
    for i, block in enumerate(model.blocks):
        assert torch.equal(tables(i, mod), mod + block.modulation)
    assert tables(0, mod).data_ptr() == first.data_ptr()  # the same (L, 4, dim) tensor: one add
    other, _ = model.time_modulation(torch.tensor(0.25, device=DEVICE))
    assert torch.equal(tables(1, other), other + model.blocks[1].modulation)  # a new pass's mod: new tables
    with torch.no_grad():
        model.blocks[1].modulation.add_(1.0)
    assert torch.equal(tables(1, other), other + model.blocks[1].modulation)  # an in-place change of a table
    with torch.no_grad():
        other.mul_(2.0)
    assert torch.equal(tables(0, other), other + model.blocks[0].modulation)  # an in-place change of mod


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_branch_streams_give_the_same_block_output_eagerly_and_in_a_cuda_graph():
    """The MLP branch on a side stream computes exactly what it computes in line (same kernels, same inputs)."""
    import copy

    from engine.cache import attention
    from engine.model import apply_head_norm
    from engine.kernels.fp8_linear import quantize_linears_

    model = _model()
    inline = quantize_linears_(copy.deepcopy(model), fuse=True, branch_streams=False)
    side = quantize_linears_(copy.deepcopy(model), fuse=True, branch_streams=True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(SPEC.frame_tokens, SPEC.dim, generator=g).to(DEVICE, next(model.parameters()).dtype)
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    attend = lambda q, k, v, head_norm=None, fp8_out=False: attention(*apply_head_norm(q, k, v, head_norm))
    run = lambda m: m.blocks[1](m.blocks[0](x, mod, attend), mod, attend)
    with torch.no_grad():
        want = run(inline)
        assert torch.equal(run(side), want)
        graph = torch.cuda.CUDAGraph()
        run(side)  # warm-up outside capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            got = run(side)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(got, want)


_HOPPER_BUILD = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import FP_FUSION
from engine.kernels.fused_block import _gated_sum_kernel, _gated_sum_ln_quant_kernel, _ln_mod_quant_kernel
from engine.kernels.rope_write import _write_frame_kernel

hopper = GPUTarget("cuda", 90, 32)
rows = {"x": "*bf16", "shift": "*bf16", "scale": "*bf16", "h8": "*fp8e4nv", "sh": "*fp32", "K": "i32", "eps": "fp32",
        "BLOCK_K": "constexpr", "EXACT": "constexpr", "PDL": "constexpr"}
gated = {"a": "*bf16", "m": "*bf16", "ga": "*bf16", "gm": "*bf16", "x": "*bf16", "y": "*bf16", "shift": "*bf16", "scale": "*bf16",
         "h8": "*fp8e4nv", "sh": "*fp32", "K": "i32", "eps": "fp32", "BLOCK_K": "constexpr", "EXACT": "constexpr",
         "PDL": "constexpr"}
write = {**{n: "*bf16" for n in ("q", "k", "v")}, **{n: "i32" for n in ("s_qh", "s_qt", "s_kh", "s_kt", "s_vh", "s_vt")},
         "cos": "*fp32", "sin": "*fp32", "pos_idx": "*i32", "slot": "*i32", "q8": "*fp8e4nv", "k_cache": "*fp8e4nv",
         "vt_cache": "*fp8e4nv", "valid": "*i8", "q_scale": "*fp32", "k_scale": "*fp32", "v_scale": "*fp32", "gains": "*bf16",
         "eps": "fp32", "F": "i32", "S": "i32", "H": "i32", "D": "constexpr", "BLOCK_T": "constexpr", "EXACT": "constexpr",
         "NORM": "constexpr", "PV_ORDER": "constexpr", "PDL": "constexpr"}
plain_sum = {n: gated[n] for n in ("a", "m", "ga", "gm", "x", "y", "K")}
plain_sum.update(HAS_X="constexpr", BLOCK_K="constexpr")
for kernel, sig, const in (*((_ln_mod_quant_kernel, rows, {"BLOCK_K": 8192, "EXACT": False, "PDL": pdl}) for pdl in (False, True)),
                           (_gated_sum_kernel, plain_sum, {"HAS_X": True, "BLOCK_K": 1024}),
                           *((_gated_sum_ln_quant_kernel, gated, {"BLOCK_K": 8192, "EXACT": False, "PDL": pdl}) for pdl in (False, True)),
                           *((_write_frame_kernel, write, {"D": 128, "BLOCK_T": t, "EXACT": False, "NORM": True, "PV_ORDER": pv,
                                                           "PDL": pdl})
                             for t in (16, 64) for pv in (False, True) for pdl in (False, True))):
    pdl = const.get("PDL", False)
    built = triton.compile(ASTSource(kernel, sig, constexprs=const), target=hopper,
                           options={"num_warps": 8, **FP_FUSION, **({"launch_pdl": True} if pdl else {})})
    ptx = built.asm["ptx"]
    assert ".target sm_90" in ptx, kernel
    # with PDL every program waits for the previous kernel before its first load, and none lets the next one launch early
    assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx, (kernel, const)
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), (kernel, const)
    if kernel is _write_frame_kernel:  # V's (D, BLOCK_T) store runs along the slots in either order: coalesced
        ir = built.asm["ttgir"]
        store = re.search(r"tt\.store [^\n]*tensor<128x%dx!tt\.ptr<f8E4M3FN>, (#\w+)>" % const["BLOCK_T"], ir).group(1)
        lanes, order = re.search(store + r" = #ttg\.blocked<\{[^}]*threadsPerWarp = \[\d+, (\d+)\][^}]*order = \[(\d)", ir).groups()
        assert int(lanes) >= 8 and order == "1", (const, store, lanes, order)
print("built")
"""


_FUSION_BUILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import FP_FUSION
from engine.kernels.fused_block import _gated_sum_kernel

sig = {n: "*bf16" for n in ("a", "m", "ga", "gm", "x", "y")}
sig.update(K="i32", HAS_X="constexpr", BLOCK_K="constexpr")
for options in (FP_FUSION, {"enable_fp_fusion": False}):
    built = triton.compile(ASTSource(_gated_sum_kernel, sig, constexprs={"HAS_X": True, "BLOCK_K": 1024}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
    print(built.asm["ptx"].count("fma.rn.f32"))
"""


def test_every_kernel_launch_asks_for_fma_fusion():
    """Triton 3.9 warns that 3.10 will turn FP fusion off by default: every launch in engine/kernels passes
    FP_FUSION, and it is what makes the compiler fuse (gate_a * a + gate_m * m + x built with it and without)."""
    import ast

    kernels_dir = Path(__file__).resolve().parent.parent / "engine" / "kernels"
    launches = missing = 0
    for path in sorted(kernels_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # kernel[grid](...) launches, whatever name the kernel goes by there (every call of a subscript in
            # engine/kernels is one), and triton.compile(...) builds
            is_launch = isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            is_build = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compile"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton")
            if not (is_launch or is_build):
                continue
            launches += 1
            spread = [k.value for k in node.keywords if k.arg is None]
            options = [k.value for k in node.keywords if k.arg == "options"]
            if options and isinstance(options[0], ast.Dict):
                spread += [v for k, v in zip(options[0].keys, options[0].values) if k is None]
            if not any(isinstance(v, ast.Name) and v.id == "FP_FUSION" for v in spread):
                missing += 1
                print(f"{path.name}:{node.lineno} launches without **FP_FUSION")
    assert launches >= 14 and missing == 0, (launches, missing)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _FUSION_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fused, unfused = map(int, out.stdout.split()[-2:])
    assert fused > 0 and unfused == 0, (fused, unfused)


def test_the_block_and_cache_kernels_build_for_hopper():
    """The GPU build of the kernels the fused block and the ring cache launch (ptxas ships with Triton): this
    process runs them in the interpreter, so they are compiled in a fresh one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("built"), out.stderr[-3000:]
