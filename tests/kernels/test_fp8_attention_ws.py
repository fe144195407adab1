"""The warp-specialised FP8 attention kernel (Gluon, Hopper only).

Everywhere: it builds for sm_90a (Triton ships ptxas), with the tensor-core and register settings it
is designed around. On a Hopper GPU: within 3% (relative L2) of exact attention over the same FP8 cache,
as fp8_attention.py's kernel is (both products in e4m3).
"""

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

pytest.importorskip("triton.experimental.gluon")

from engine import fp8  # noqa: E402
from engine.kernels import attention_kernel  # noqa: E402
from engine.kernels.fp8_attention import attention_reference, qk_scale  # noqa: E402
from engine.kernels.fp8_attention_ws import (HOPPER_SM, WarpSpecializedFP8Attention, compile_for_hopper,  # noqa: E402
                                             e4m3_log_linear, programs_per_sm, pv_slot_order)
from engine.cache import RingKVCache  # noqa: E402
from tests.helpers import rms_heads, run_session  # noqa: E402
from tests.kernels.shared import DEVICE, SPEC, kernel_model  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def cache_inputs(seed: int, H: int, M: int, S: int, D: int, dev) -> tuple:
    """Unit-RMS q, K, V in e4m3 at one random scale per head (Vᵀ as the cache stores it) and a validity mask with
    empty ring slots (40..129): (q8, k8, vt8, valid, scale)."""
    g = torch.Generator().manual_seed(seed)
    scale = fp8.per_head_scale(torch.rand(H, D, generator=g).to(dev) + 0.5)
    q8, k8 = (fp8.quantize(rms_heads(g, H, n, D).to(dev), scale) for n in (M, S))
    vt8 = fp8.quantize(rms_heads(g, H, S, D).to(dev), scale).transpose(1, 2).contiguous()
    valid = torch.ones(S, dtype=torch.int8, device=dev)
    valid[40:130] = 0
    return q8, k8, vt8, valid, scale


def spill_store_bytes(ptx: str) -> int:
    """Register spill stores ptxas reports for this PTX (spills are made there, after the PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = Path(get_ptxas(90).path)  # the one Triton builds sm_90a with (Triton 3.9 ships two)
    if not ptxas.is_file():
        pytest.skip("this Triton ships no ptxas")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        report = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(Path(d) / "k.ptx"), "-o", str(Path(d) / "k.o")],
                                capture_output=True, text=True, check=True).stderr
    return int(re.search(r"(\d+) bytes spill stores", report).group(1))


# (block_m, block_n, stages, head_dim), and the spill stores measured when written: a guard against growth
# (the larger of Triton 3.6's build and Triton 3.9's: 3.9 spills 72 bytes where 3.6 spilt 64 with renamed_p False)
# out_fp8: the output written in e4m3 (the serving block's choice) instead of bf16
@pytest.mark.parametrize("block_m, block_n, stages, head_dim, pingpong, renamed_p, spills, out_fp8", [
    (64, 128, 3, 128, False, True, 64, False), (128, 128, 2, 128, False, True, 88, False), (64, 64, 4, 128, False, True, 0, False),
    (64, 128, 3, 64, False, True, 0, False), (128, 128, 2, 128, True, True, 88, False), (64, 128, 2, 128, False, False, 72, False),
    (64, 128, 2, 128, False, True, 68, True)])
def test_builds_for_hopper_with_async_tensor_cores_and_few_spills(block_m, block_n, stages, head_dim, pingpong, renamed_p,
                                                                  spills, out_fp8):
    kernel = compile_for_hopper(head_dim, block_m=block_m, block_n=block_n, stages=stages, pingpong=pingpong,
                                renamed_p=renamed_p, out_fp8=out_fp8)
    ptx = kernel.asm["ptx"]
    # renamed in place, P never moves between threads: only the row reductions' shuffles stay (per consumer warpgroup)
    assert (ptx.count("shfl.sync") / (block_m // 64) < 20) == renamed_p
    assert ".target sm_90a" in ptx
    assert ptx.count("wgmma.mma_async") > 0 and "wgmma.wait_group.sync.aligned 1" in ptx  # q·kᵀ waited on, P·V in flight
    assert "setmaxnreg" in ptx  # producer warp gives its registers to the consumers
    assert "cp.async.bulk.tensor" in ptx  # TMA loads
    assert spill_store_bytes(ptx) <= spills
    assert programs_per_sm(kernel) == (2 if block_m == 64 else 1)  # two programs per SM at block_m 64


def test_programs_per_sm_takes_the_scarcest_of_registers_shared_memory_and_threads():
    kernel = compile_for_hopper(128, block_m=64, block_n=128, stages=2)  # 8 warps at 128 registers, ~72 KiB shared
    md = kernel.metadata
    assert (md.num_warps, md.maxnreg) == (8, 128)
    assert programs_per_sm(kernel) == 2  # registers: 65536 / (128 x 256)
    more_registers = {**HOPPER_SM, "registers": 4 * 65536}
    assert programs_per_sm(kernel, more_registers) == 233472 // (md.shared + 1024) == 3  # then shared memory
    assert programs_per_sm(kernel, {**more_registers, "shared_bytes": md.shared + 1024}) == 1
    assert programs_per_sm(kernel, {**more_registers, "shared_bytes": 10 * 233472, "threads": 256}) == 1


def test_v_slot_order_puts_each_thread_s_probabilities_where_its_operand_registers_read_them():
    """Per 32 slots, the thread of a wgmma accumulator row with lane index q (of 4) holds the scores of slots
    2q, 2q+1 (+ 8, 16, 24); as an 8-bit A operand the same thread supplies positions 4q..4q+3 and
    16+4q..16+4q+3. The order must send those positions to exactly those slots, so that no probability
    moves between threads; it maps each group of 16 slots onto itself, so any multiple of 16 slots works."""
    order = pv_slot_order(64)
    for q in range(4):
        held = {2 * q + c + 8 * j for j in range(4) for c in (0, 1)}
        positions = [4 * q + r + 16 * h for h in (0, 1) for r in range(4)]
        for group in (0, 32):
            assert {order[group + k].item() - group for k in positions} == held
    for n in (16, 48, 5824):
        o = pv_slot_order(n)
        assert sorted(o.tolist()) == list(range(n)) and torch.equal(o // 16, torch.arange(n) // 16)
    with pytest.raises(ValueError, match=r"the slots \(40\) must be a multiple of 16"):
        pv_slot_order(40)
    vt = torch.arange(2 * 3 * 48).view(2, 3, 48)
    assert torch.equal(WarpSpecializedFP8Attention(2, 70, 48, 32).arrange_v(vt), vt[..., pv_slot_order(48)])
    assert WarpSpecializedFP8Attention(2, 70, 48, 32, renamed_p=False).arrange_v(vt) is vt


def test_refuses_shapes_it_cannot_run():
    with pytest.raises(ValueError, match="block_m must be 64 or 128"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, block_m=32)
    with pytest.raises(ValueError, match="block_n must be 32, 64 or 128"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, block_n=100)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, stages=1)
    with pytest.raises(ValueError, match=r"the slots \(300\) must be a multiple of 16"):
        WarpSpecializedFP8Attention(2, 70, 300, 128)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(32, 64, 128\)"):
        WarpSpecializedFP8Attention(2, 70, 320, 16)
    with pytest.raises(ValueError, match="pingpong takes two consumer warpgroups: block_m 128"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, block_m=64, pingpong=True)
    with pytest.raises(ValueError, match="pingpong with row_sum='tensor' is not built"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, block_m=128, pingpong=True, row_sum="tensor")
    with pytest.raises(ValueError, match="exp2 must be one of mufu, fma, mixed, e4m3_bits, got 'sfu'"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, exp2="sfu")
    with pytest.raises(ValueError, match="row_sum must be fma or tensor, got 'sfu'"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, row_sum="sfu")
    with pytest.raises(ValueError, match=r"exp2='e4m3_bits' needs row_sum='tensor' \(P exists only as e4m3 codes"):
        WarpSpecializedFP8Attention(2, 70, 320, 128, exp2="e4m3_bits")


def test_exp2_on_the_fma_units_takes_the_probabilities_off_the_special_function_unit():
    """exp2="fma" computes every probability's 2^x on the FMA and integer units, "mixed" half of them; the
    special-function unit keeps only the rescale factors (one per row a thread holds)."""
    ex2 = {e: compile_for_hopper(128, block_m=64, block_n=128, stages=2, exp2=e).asm["ptx"].count("ex2.approx")
           for e in ("mufu", "mixed", "fma")}
    per_thread = 2 * 64 * 128 // 128  # a 64 x 128 score tile over 128 threads, at the softmax's two sites (first block, loop)
    assert ex2["mufu"] - ex2["fma"] == per_thread
    assert ex2["mixed"] - ex2["fma"] == per_thread // 2
    assert ex2["fma"] <= 4  # the rescale factors: 2 rows a thread, two sites


def test_e4m3_bits_are_within_7_5_percent_of_2_to_the_x_over_e4m3_s_normal_range():
    """The log-linear code against exact 2^x: within -7.1%/+7.5% where the code is normal (x >= -6; the nearest
    e4m3 is within 5.9% there), at most 2^-6 below it (2^-14 of the largest, 256), 0 at -inf; never decreasing."""
    x = torch.linspace(-6, 8, 200001)
    ratio = e4m3_log_linear(x) / torch.exp2(x)
    assert 0.9289 <= ratio.min().item() and ratio.max().item() <= 1.075
    nearest = torch.exp2(x).to(torch.float8_e4m3fn).float() / torch.exp2(x)
    assert (nearest - 1).abs().max().item() <= 0.059
    low = torch.linspace(-60, -6, 1001)
    assert e4m3_log_linear(low).max().item() <= 2 ** -6
    assert e4m3_log_linear(torch.tensor([float("-inf")])).item() == 0.0 and e4m3_log_linear(torch.tensor([8.0])).item() == 256.0
    grid = torch.linspace(-10, 8, 10001)
    assert (e4m3_log_linear(grid).diff() >= 0).all()


@pytest.mark.parametrize("block_m", [64, 128])
def test_e4m3_bits_and_tensor_core_row_sums_leave_the_special_function_unit_the_rescale_factors(block_m):
    """row_sum="tensor" adds a P·1 product with 8 columns (m64n8k32) beside P·V and drops the adds of P;
    exp2="e4m3_bits" computes P by one FMA a probability, a pair converted to f16x2 and clamped at once, leaving ex2
    to the rescale factors; one byte permute makes each register of P·V's operand, 4 probabilities of a row."""
    build = lambda **kw: compile_for_hopper(128, block_m=block_m, block_n=128, stages=2, **kw).asm["ptx"]
    plain, summed, bits = build(), build(row_sum="tensor"), build(row_sum="tensor", exp2="e4m3_bits")
    assert "m64n8k32" not in plain and "m64n8k32" in summed and "m64n8k32" in bits
    assert plain.count("add.f32") - summed.count("add.f32") >= 2 * 62 * (block_m // 64)  # 2 rows of 32 a thread, two sites
    assert bits.count("max.f16x2") == bits.count("cvt.rn.f16x2.f32") > 0 == summed.count("cvt.rn.f16x2.f32")
    # the operand's registers: one prmt each (64 rows x 128 slots / 128 threads / 4 a register = 16 a consumer and block),
    # at the loop's P·V and the last block's
    assert bits.count("0x6420;") == 2 * 16 * (block_m // 64)
    assert bits.count("ex2.approx") <= 4 * (block_m // 64) < plain.count("ex2.approx")
    assert bits.count("cvt.rn.satfinite.e4m3x2.f32") == 0 < plain.count("cvt.rn.satfinite.e4m3x2.f32")  # bf16 output
    assert programs_per_sm(compile_for_hopper(128, block_m=block_m, block_n=128, stages=2, row_sum="tensor",
                                              exp2="e4m3_bits")) == (2 if block_m == 64 else 1)
    assert spill_store_bytes(bits) <= (0 if block_m == 64 else 72)  # Triton 3.6's build: none; 3.9's spills 72 bytes at 128


def test_kernel_choice():
    cpu = torch.device("cpu")
    assert attention_kernel("auto", cpu, 128) == "triton"  # no GPU: the Triton kernel (interpreter)
    assert attention_kernel("triton", cpu, 128) == "triton"
    with pytest.raises(ValueError, match=r"the ws attention kernel needs a Hopper GPU .* head size 128"):
        attention_kernel("ws", cpu, 128)
    with pytest.raises(ValueError, match="attention kernel must be one of auto, triton, ws, got 'flash'"):
        attention_kernel("flash", cpu, 128)
    if HOPPER:
        cuda = torch.device("cuda")
        assert attention_kernel("auto", cuda, 128) == "ws"
        assert attention_kernel("auto", cuda, 16) == "triton"  # a head size it is not built for


def test_the_probe_builds_the_kernel_and_falls_back_where_this_triton_cannot(monkeypatch, caplog):
    """On a Hopper GPU the ws kernel is chosen only where this Triton builds it: a Gluon API that moved between
    Triton versions turns it off with one log line (the Triton kernel serves) instead of failing at the first call."""
    import logging

    from engine.kernels.launch import hopper_feature
    from engine.kernels.policy import _build_ws_attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "a Hopper GPU")

    def moved() -> None:
        raise RuntimeError("async_copy_global_to_shared has been removed; call async_load instead")

    with caplog.at_level(logging.INFO, logger="talkloop.kernels"):
        assert not hopper_feature(0, "ws attention", "json", "the Triton kernel serves", build=moved)
        assert hopper_feature(0, "ws attention", "json", "the Triton kernel serves", build=_build_ws_attention)
    assert ("ws attention off: this Triton does not build it (RuntimeError: async_copy_global_to_shared has been "
            "removed; call async_load instead); the Triton kernel serves") in caplog.text
    assert "ws attention on (a Hopper GPU)" in caplog.text


def test_marks_only_fully_live_tiles():
    valid = torch.ones(336, dtype=torch.int8)
    valid[40:130] = 0  # empty ring slots: tiles 0 and 1 of 64 hold some, tile 2 does too (128, 129)
    att = WarpSpecializedFP8Attention(2, 70, 336, 128, block_n=64)
    assert att.tile_live.tolist() == [0] * 6  # masked everywhere until marked
    att.mark_live_tiles(valid)
    assert att.tile_live.tolist() == [0, 0, 0, 1, 1, 0]  # the last tile (320..335) is partial: masked


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("block_m, block_n, stages, S, marked, D, pingpong, renamed_p", [
    (64, 128, 3, 320, True, 128, False, True), (64, 128, 2, 5824, True, 128, False, True),
    (64, 128, 2, 5824, False, 128, False, True), (128, 128, 2, 320, True, 128, False, True),
    (128, 128, 2, 1024, True, 128, False, True), (64, 64, 4, 512, True, 128, False, True),
    (64, 64, 6, 336, True, 128, False, True), (64, 128, 3, 1024, True, 64, False, True),
    (64, 32, 3, 336, True, 64, False, True), (128, 128, 2, 320, True, 128, True, True),
    (128, 128, 2, 5824, False, 128, True, True), (128, 128, 3, 1024, True, 64, True, True),
    (64, 128, 2, 5824, True, 128, False, False), (128, 128, 2, 320, True, 128, False, False)])
def test_matches_exact_attention_over_the_same_cache(block_m, block_n, stages, S, marked, D, pingpong, renamed_p):
    """S = 320 leaves a partial last tile (slots past S masked, the next head's K rows read and ignored);
    M = 70 a partial query tile; the empty ring slots are masked; D = 64 is the demo model's head. Marked: tiles known fully live skip
    the mask; unmarked, every tile is masked. pingpong: the two consumer warpgroups issue their products in turns.
    renamed_p: P renamed in its registers, V's slots reordered to match (False: V in slot order, P shuffled)."""
    g = torch.Generator().manual_seed(1)
    H, M, dev = 3, 70, torch.device("cuda")
    rms = lambda *shape: rms_heads(g, *shape).to(dev)
    scale = fp8.per_head_scale(torch.rand(H, D, generator=g).to(dev) + 0.5)
    q8, k8 = fp8.quantize(rms(H, M, D), scale), fp8.quantize(rms(H, S, D), scale)
    vt8 = fp8.quantize(rms(H, S, D), scale).transpose(1, 2).contiguous()
    valid = torch.ones(S, dtype=torch.int8, device=dev)
    valid[40:130] = 0
    out = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=dev)
    attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=block_n, stages=stages,
                                            pingpong=pingpong, renamed_p=renamed_p)
    if marked:
        attention.mark_live_tiles(valid)
        assert (attention.tile_live.sum().item() > 0) == (S != 320)  # the unmasked path runs too
    attention(q8, k8, attention.arrange_v(vt8), valid, qk_scale(scale, scale, D), scale, out)
    ref = attention_reference(q8, k8, vt8, valid, scale, scale, scale)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("exp2", ["mixed", "fma"])
@pytest.mark.parametrize("block_m, S", [(64, 5824), (128, 320)])
def test_exp2_on_the_fma_units_matches_exact_attention_and_the_special_function_units_output(exp2, block_m, S):
    """The polynomial's 2^x (relative error below 0.2%) before e4m3's rounding of P (up to 6%): within the same 3%
    of exact attention, and within 1% of the kernel with 2^x on the special-function unit."""
    H, M, D, dev = 3, 70, 128, torch.device("cuda")
    q8, k8, vt8, valid, scale = cache_inputs(4, H, M, S, D, dev)
    outs = {}
    for unit in ("mufu", exp2):
        attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=128, stages=2, exp2=unit)
        attention.mark_live_tiles(valid)
        outs[unit] = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=dev)
        attention(q8, k8, attention.arrange_v(vt8), valid, qk_scale(scale, scale, D), scale, outs[unit])
    ref = attention_reference(q8, k8, vt8, valid, scale, scale, scale)
    out, sfu = outs[exp2].float(), outs["mufu"].float()
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() <= 3e-2
    assert ((out - sfu).norm() / sfu.norm()).item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("block_m, S", [(64, 5824), (128, 5824), (128, 320)])
def test_tensor_core_row_sums_and_e4m3_bits_match_exact_attention(block_m, S):
    """Row sums from the tensor cores (of the e4m3 P that P·V reads): within the same 3% of exact attention and
    within 1% of the kernel's FP32 sums. With 2^x as log-linear e4m3 codes (up to 7.5% off 2^x where nearest
    rounding is 5.9% off): within 4% of exact attention, and within 1.5% with scores four times as sharp."""
    g = torch.Generator().manual_seed(5)
    H, M, D, dev = 3, 70, 128, torch.device("cuda")
    scale = fp8.per_head_scale(torch.rand(H, D, generator=g).to(dev) + 0.5)
    q, k = rms_heads(g, H, M, D).to(dev), rms_heads(g, H, S, D).to(dev)
    k8 = fp8.quantize(k, scale)
    vt8 = fp8.quantize(rms_heads(g, H, S, D).to(dev), scale).transpose(1, 2).contiguous()
    valid = torch.ones(S, dtype=torch.int8, device=dev)
    valid[40:130] = 0
    for sharpness, bits_tolerance in ((1.0, 4e-2), (4.0, 1.5e-2)):
        q_scale = fp8.per_head_scale((sharpness * q).abs().amax(1))
        q8 = fp8.quantize(sharpness * q, q_scale)
        outs = {}
        for options in ({}, {"row_sum": "tensor"}, {"row_sum": "tensor", "exp2": "e4m3_bits"}):
            attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=128, stages=2, **options)
            attention.mark_live_tiles(valid)
            out = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=dev)
            attention(q8, k8, attention.arrange_v(vt8), valid, qk_scale(q_scale, scale, D), scale, out)
            assert torch.isfinite(out).all()
            outs[options.get("exp2", options.get("row_sum", "fma"))] = out.float()
        ref = attention_reference(q8, k8, vt8, valid, q_scale, scale, scale)
        err = lambda out, want: ((out - want).norm() / want.norm()).item()
        assert err(outs["tensor"], ref) <= 3e-2 and err(outs["tensor"], outs["fma"]) <= 1e-2
        assert err(outs["e4m3_bits"], ref) <= bits_tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("block_m, block_n, S", [(64, 128, 5824), (64, 64, 336), (128, 128, 320), (64, 32, 336)])
def test_row_maxima_as_a_tree_give_the_plain_reductions_output_bit_for_bit(block_m, block_n, S):
    """The tree only reorders the maxima's comparisons: same maxima, same output, masked tiles included."""
    g = torch.Generator().manual_seed(3)
    H, M, D, dev = 3, 70, 64 if block_n == 32 else 128, torch.device("cuda")
    scale = fp8.per_head_scale(torch.rand(H, D, generator=g).to(dev) + 0.5)
    q8, k8 = (fp8.quantize(rms_heads(g, H, n, D).to(dev), scale) for n in (M, S))
    vt8 = fp8.quantize(rms_heads(g, H, S, D).to(dev), scale).transpose(1, 2).contiguous()
    valid = torch.ones(S, dtype=torch.int8, device=dev)
    valid[40:130] = 0
    outs = []
    for tree_max in (True, False):
        attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=block_n, stages=2, tree_max=tree_max)
        attention.mark_live_tiles(valid)
        out = torch.full((M, H * D), float("nan"), dtype=torch.bfloat16, device=dev)
        attention(q8, k8, attention.arrange_v(vt8), valid, qk_scale(scale, scale, D), scale, out)
        outs.append(out)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("block_m, S", [(64, 5824), (64, 320), (128, 1024)])
def test_e4m3_output_is_the_bf16_output_rounded_at_a_scale_that_never_saturates(block_m, S):
    """As fp8_attention.py's kernel: with an e4m3 `out` and V's scales divided by `out_scale`, the bf16 output
    rounded to e4m3; V at e4m3's largest value (the scale's worst case) still below 448."""
    from tests.helpers import assert_e4m3_output_never_saturates, v_scale_worst_case

    g = torch.Generator().manual_seed(2)
    H, M, D, dev = 3, 70, 128, torch.device("cuda")
    scale, vt8 = v_scale_worst_case(g, H, S, D, dev)
    q8, k8 = fp8.quantize(rms_heads(g, H, M, D).to(dev), scale), fp8.quantize(rms_heads(g, H, S, D).to(dev), scale)
    valid = torch.ones(S, dtype=torch.int8, device=dev)
    valid[40:130] = 0
    attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=128, stages=2)
    attention.mark_live_tiles(valid)
    assert_e4m3_output_never_saturates(attention, q8, k8, attention.arrange_v(vt8), valid, scale, S)


def test_tma_out_writes_the_output_through_shared_memory_and_the_copy_engine():
    """tma_out: each consumer warpgroup's output tile goes to shared memory and out by a TMA store (no store from
    registers left), at the same programs per SM for 128-row tiles, and no more spills than the build without."""
    for out_fp8 in (False, True):
        build = lambda **kw: compile_for_hopper(128, block_m=128, block_n=128, stages=2, row_sum="tensor",
                                                exp2="e4m3_bits", out_fp8=out_fp8, **kw)
        plain, staged = build(), build(tma_out=True)
        assert "cp.async.bulk.tensor.2d.global.shared" in staged.asm["ptx"] and "st.global" not in staged.asm["ptx"]
        assert "cp.async.bulk.tensor.2d.global.shared" not in plain.asm["ptx"]
        assert programs_per_sm(staged) == programs_per_sm(plain) == 1
        assert spill_store_bytes(staged.asm["ptx"]) <= spill_store_bytes(plain.asm["ptx"])


def test_tma_out_refuses_an_output_a_tma_descriptor_cannot_address():
    att = WarpSpecializedFP8Attention(2, 70, 320, 64, block_m=128, tma_out=True)
    rows = torch.zeros(70, 2 * 64 + 8, dtype=torch.bfloat16)
    att.out_descriptor(rows[:, :128])  # a row stride of 272 bytes: fine
    with pytest.raises(ValueError, match="row stride of 260 bytes"):
        att.out_descriptor(torch.zeros(70, 130, dtype=torch.bfloat16)[:, :128])
    with pytest.raises(ValueError, match="got address 2 past 16 bytes"):
        att.out_descriptor(rows.view(-1)[1:1 + 70 * 128].view(70, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("block_m, S", [(128, 5824), (128, 320), (64, 1024)])
def test_tma_out_writes_the_same_output_bit_for_bit(block_m, S):
    """The same values, written by the copy engine: bf16 and e4m3 outputs equal the register store's bit for bit,
    the rows past M (a partial last tile) left untouched."""
    H, M, D, dev = 3, 70, 128, torch.device("cuda")
    q8, k8, vt8, valid, scale = cache_inputs(7, H, M, S, D, dev)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        outs = []
        for tma_out in (False, True):
            attention = WarpSpecializedFP8Attention(H, M, S, D, dev, block_m=block_m, block_n=128, stages=2,
                                                    row_sum="tensor", exp2="e4m3_bits", tma_out=tma_out)
            attention.mark_live_tiles(valid)
            buffer = torch.full((M + 8, H * D), 7.0, device=dev).to(dtype)  # rows M.. must stay as they are
            attention(q8, k8, attention.arrange_v(vt8), valid, qk_scale(scale, scale, D), scale, buffer[:M])
            outs.append(buffer)
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
        assert (outs[1][M:].float() == 7.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
@pytest.mark.parametrize("p_options, tolerance", [({}, 3e-2), ({"exp2": "mufu", "row_sum": "fma"}, 2e-2)])
def test_warp_specialized_attention_session_tracks_the_pytorch_fp8_session(p_options, tolerance):
    """As served (P as log-linear e4m3 codes, row sums on the tensor cores): within 3% of the PyTorch FP8 session
    after 8 steps; with P the e4m3 value nearest 2^x and FP32 row sums, within 2%."""
    model = kernel_model()
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
