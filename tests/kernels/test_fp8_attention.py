"""engine/kernels/fp8_attention.py against exact attention over the same FP8 cache (attention_reference), and
the ring cache's sessions on it (interpreter on CPU, hardware on GPU).

Tolerance: within 3% (relative L2) of exact attention over the same FP8 cache (the probabilities are rounded to
e4m3 too).
"""


import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from engine import fp8  # noqa: E402
from engine.kernels.fp8_attention import FP8Attention, _exp2_fma, attention_reference, qk_scale  # noqa: E402
from tests.helpers import (assert_e4m3_output_is_bf16_output_rounded, assert_e4m3_output_never_saturates,  # noqa: E402
                           rms_heads, run_session, v_scale_worst_case)
from tests.kernels.shared import DEVICE, SPEC, kernel_model, make_caches  # noqa: E402


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


def test_triton_session_tracks_the_pytorch_fp8_session():
    model = kernel_model()
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


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps():
    model = kernel_model()
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

    model = kernel_model()
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
