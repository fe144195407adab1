"""engine/kernels/rope_write.py (the frame write, the sink store, the reset's delta rotation) against the
PyTorch ring cache, engine/cache.py's torch backend (interpreter on CPU, hardware on GPU).

Tolerance: equal to the PyTorch path except for rare one-step e4m3 rounding differences (fused multiply-adds).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from engine import fp8  # noqa: E402
from engine.cache import RingKVCache  # noqa: E402
from engine.kernels.fp8_attention import FP8Attention  # noqa: E402
from tests.helpers import rms_heads  # noqa: E402
from tests.kernels.shared import DEVICE, SPEC, close_fp8, make_caches  # noqa: E402


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


_HOPPER_BUILD = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.launch import FP_FUSION
from engine.kernels.rope_write import _write_frame_kernel

hopper = GPUTarget("cuda", 90, 32)
write = {**{n: "*bf16" for n in ("q", "k", "v")}, **{n: "i32" for n in ("s_qh", "s_qt", "s_kh", "s_kt", "s_vh", "s_vt")},
         "cos": "*fp32", "sin": "*fp32", "pos_idx": "*i32", "slot": "*i32", "q8": "*fp8e4nv", "k_cache": "*fp8e4nv",
         "vt_cache": "*fp8e4nv", "valid": "*i8", "q_scale": "*fp32", "k_scale": "*fp32", "v_scale": "*fp32", "gains": "*bf16",
         "eps": "fp32", "F": "i32", "S": "i32", "H": "i32", "D": "constexpr", "BLOCK_T": "constexpr", "EXACT": "constexpr",
         "NORM": "constexpr", "PV_ORDER": "constexpr", "PDL": "constexpr"}
for t in (16, 64):
    for pv in (False, True):
        for pdl in (False, True):
            const = {"D": 128, "BLOCK_T": t, "EXACT": False, "NORM": True, "PV_ORDER": pv, "PDL": pdl}
            built = triton.compile(ASTSource(_write_frame_kernel, write, constexprs=const), target=hopper,
                                   options={"num_warps": 8, **FP_FUSION, **({"launch_pdl": True} if pdl else {})})
            ptx = built.asm["ptx"]
            assert ".target sm_90" in ptx
            # with PDL every program waits for the previous kernel before its first load, and none lets the next one
            # launch early
            assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx, const
            if pdl:
                assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), const
            # V's (D, BLOCK_T) store runs along the slots in either order: coalesced
            ir = built.asm["ttgir"]
            store = re.search(r"tt\.store [^\n]*tensor<128x%dx!tt\.ptr<f8E4M3FN>, (#\w+)>" % t, ir).group(1)
            lanes, order = re.search(store + r" = #ttg\.blocked<\{[^}]*threadsPerWarp = \[\d+, (\d+)\][^}]*order = \[(\d)", ir).groups()
            assert int(lanes) >= 8 and order == "1", (const, store, lanes, order)
print("built")
"""


def test_the_frame_write_kernel_builds_for_hopper():
    """The GPU build of the frame write (ptxas ships with Triton): this process runs it in the interpreter, so it
    is compiled in a fresh one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("built"), out.stderr[-3000:]
