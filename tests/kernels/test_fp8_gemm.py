"""The Triton FP8 GEMM (engine/kernels/fp8_gemm.py) and MLP-in's interleaved gate/up layout.

Tolerances: the plain form equals the dequantised float product but for bf16 rounding of the
output (relative L2 <= 1e-3); on a GPU with the tensor cores' fast accumulation it matches cuBLAS's
fast accumulation (<= 1e-3 apart) and errs no more than 1.5x as much from the exact product. The SwiGLU
form's per-row FP8 output is within 4% (relative L2) of the exact silu(gate) * up, and within 10%
of the error the cuBLAS path makes (both round to e4m3: ~2% each).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.fp8_gemm import FP8GEMM, fp8_gemm_reference, interleave_gate_up  # noqa: E402
from engine.kernels.fp8_linear import FP8Linear  # noqa: E402
from engine.kernels.fused_block import swiglu_quant  # noqa: E402
from engine.kernels.policy import default_gemm_kernels  # noqa: E402
from tests.helpers import rel, run_session  # noqa: E402
from tests.kernels.shared import kernel_model  # noqa: E402

E4M3 = torch.float8_e4m3fn
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Small tiles keep the interpreter quick; the GPU's FP8 tensor cores take 64-row tiles and up.
TILES = dict(block_m=32, block_n=64, block_k=32) if DEVICE.type == "cpu" else dict(block_m=64, block_n=64, block_k=64, num_warps=4)


def operands(M, K, rows, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x8 = (torch.randn(M, K, generator=g) * 3).to(E4M3)
    w8 = (torch.randn(rows, K, generator=g) * 3).to(E4M3)
    sx = torch.rand(M, 1, generator=g) + 0.5
    sw = torch.rand(rows, generator=g) + 0.5
    return x8.to(device), sx.to(device), w8.to(device), sw.to(device)


def interleaved(w8: torch.Tensor, sw: torch.Tensor, block: int):
    return interleave_gate_up(w8.view(torch.uint8), block).view(E4M3).contiguous(), interleave_gate_up(sw, block)


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("M", [100, 5])  # rows past the last full tile, and fewer rows than one tile
def test_plain_form_matches_reference(M, persistent):
    x8, sx, w8, sw = operands(M, 96, 128)
    y = FP8GEMM(w8, sw, persistent=persistent, **TILES)(x8, sx)
    assert y.shape == (M, 128) and y.dtype == torch.bfloat16
    assert rel(y, fp8_gemm_reference(x8, sx, w8, sw)) <= 1e-3


def test_swiglu_form_matches_reference():
    x8, sx, w8, sw = operands(70, 64, 256)  # [gate; up], 128 output columns
    wi, si = interleaved(w8, sw, 64)
    y = FP8GEMM(wi, si, swiglu=True, **TILES)(x8, sx)
    assert y.shape == (70, 128)
    assert rel(y, fp8_gemm_reference(x8, sx, w8, sw, swiglu=True)) <= 1e-3


def test_interleave_gate_up_order():
    w = torch.arange(8).float()[:, None]  # gate rows 0..3, up rows 4..7
    assert interleave_gate_up(w, 2).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_bad_shapes_are_named():
    x8, sx, w8, sw = operands(8, 64, 96)
    with pytest.raises(ValueError, match="multiple of block_n"):
        FP8GEMM(w8, sw, block_n=64)
    with pytest.raises(ValueError, match="even number of rows"):
        FP8GEMM(w8[:95].contiguous(), sw[:95], swiglu=True, block_n=32)
    with pytest.raises(ValueError, match="one scale per weight row"):
        FP8GEMM(w8, sw[:10], block_n=32)
    with pytest.raises(ValueError, match="x8 must be"):
        FP8GEMM(w8, sw, block_n=32, block_k=32)(x8[:, :32].contiguous(), sx)
    with pytest.raises(ValueError, match="out must be"):
        FP8GEMM(w8, sw, block_n=32, block_k=32)(x8, sx, out=torch.empty(8, 95, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="gate_up|block_n"):
        interleave_gate_up(torch.zeros(100, 4), 64)


def test_swiglu_quant_reads_interleaved_columns():
    gu = torch.randn(6, 256, device=DEVICE).bfloat16()
    blocked = gu.view(6, 2, 2, 64).transpose(1, 2).reshape(6, 256)  # [g0 u0 g1 u1], blocks of 64
    a8, sa = swiglu_quant(gu)
    b8, sb = swiglu_quant(blocked, interleave=64)
    assert torch.equal(a8.float(), b8.float()) and torch.equal(sa, sb)


def test_fp8_linear_with_interleaved_rows_keeps_its_outputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 256, bias=False).to(DEVICE)
    plain, blocked = FP8Linear(lin), FP8Linear(lin, gate_up_block=64)
    x = torch.randn(9, 64, device=DEVICE)
    assert torch.equal(plain(x), blocked(x))  # [gate | up] order either way
    x8, sx = (torch.randn(9, 64, device=DEVICE) * 3).to(E4M3), torch.rand(9, 1, device=DEVICE) + 0.5
    m_a, s_a = plain.swiglu_quantized(x8, sx)
    m_b, s_b = blocked.swiglu_quantized(x8, sx)
    assert torch.equal(m_a.float(), m_b.float()) and torch.equal(s_a, s_b)


def widths(mlp_in, qkv=7680, mlp_out=7680, attn_out=7680):
    return {"qkv": qkv, "attn_out": attn_out, "mlp_in": mlp_in, "mlp_out": mlp_out}


def test_default_kernels_take_triton_only_where_the_swiglu_form_tiles(monkeypatch):
    assert default_gemm_kernels(torch.device("cpu"), widths(2048)) == {}
    assert default_gemm_kernels(None, widths(2048)) == {}
    if DEVICE.type == "cuda":
        assert default_gemm_kernels(DEVICE, widths(2 * 96)) == {}  # gate/up halves of 96 columns: no 128-wide tiles
        # q/k/v, the out-projection and MLP-out go with MLP-in, and only where all three outputs tile in 256 columns
        four = dict.fromkeys(("mlp_in", "qkv", "attn_out", "mlp_out"), "triton")
        assert default_gemm_kernels(DEVICE, widths(2048)) == four
        assert default_gemm_kernels(DEVICE, widths(2048, qkv=5760)) == {"mlp_in": "triton"}
        assert default_gemm_kernels(DEVICE, widths(2048, mlp_out=384)) == {"mlp_in": "triton"}
        assert default_gemm_kernels(DEVICE, widths(2048, attn_out=384)) == {"mlp_in": "triton"}
    monkeypatch.setenv("TALKLOOP_FP8_GEMM", "cublas")  # the way back to cuBLAS everywhere
    assert default_gemm_kernels(DEVICE, widths(2048)) == {}
    monkeypatch.setenv("TALKLOOP_FP8_GEMM", "triton-please")
    with pytest.raises(ValueError, match="TALKLOOP_FP8_GEMM must be auto or cublas"):
        default_gemm_kernels(DEVICE, widths(2048))


def test_the_hopper_rule_at_the_57b_shard_s_degrees():
    from engine.kernels.policy import hopper_gemm_kernels

    four = dict.fromkeys(("mlp_in", "qkv", "attn_out", "mlp_out"), "triton")
    assert hopper_gemm_kernels(widths(2 * 24576 // 3, qkv=3 * 7680 // 3)) == four  # degree 3
    assert hopper_gemm_kernels(widths(2 * 24576, qkv=3 * 7680)) == four  # degree 1
    assert hopper_gemm_kernels(widths(2 * 24576 // 4, qkv=3 * 7680 // 4)) == {"mlp_in": "triton"}  # degree 4: q/k/v 5760 wide
    assert hopper_gemm_kernels(widths(2 * 96)) == {}


def test_plain_tiles_are_256_wide_where_the_output_tiles_in_them():
    from engine.kernels.fp8_linear import plain_block_n

    assert plain_block_n(7680) == 256 and plain_block_n(5760) == 128 and plain_block_n(384) == 128
    assert FP8Linear(torch.nn.Linear(64, 512, bias=False)).block_n == 256
    assert FP8Linear(torch.nn.Linear(64, 384, bias=False)).block_n == 128
    lin = FP8Linear(torch.nn.Linear(64, 512, bias=False))
    assert lin._triton_gemm(False).block_n == 256
    lin.block_n = 128  # a launcher made for the old width is not reused
    assert lin._triton_gemm(False).block_n == 128


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{}, dict(block_n=256, stages=3)])  # the launcher's defaults; as served where outputs tile in 256
def test_gpu_plain_form_against_reference_and_cublas(tiles):
    x8, sx, w8, sw = operands(757, 1024, 2048)
    exact = fp8_gemm_reference(x8, sx, w8, sw)
    promoted = FP8GEMM(w8, sw, fast_accum=False, **tiles)(x8, sx)
    assert rel(promoted, exact) <= 1e-3
    fast = FP8GEMM(w8, sw, **tiles)(x8, sx)
    cublas = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw[None], out_dtype=torch.bfloat16, use_fast_accum=True)
    assert rel(fast, cublas) <= 1e-3  # the same fast accumulation
    assert rel(fast, exact) <= 1.5 * rel(cublas, exact) + 1e-4, (rel(fast, exact), rel(cublas, exact))


@pytest.mark.gpu
def test_gpu_swiglu_through_fp8_linear_and_a_cuda_graph():
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 2 * 1024, bias=False).cuda()
    x8, sx = (torch.randn(757, 1024, device="cuda") * 3).to(E4M3), torch.rand(757, 1, device="cuda") / 100 + 1e-3
    fast = FP8Linear(lin, fast_accum=True, gemm_kernel="triton", gate_up_block=128)
    slow = FP8Linear(lin, fast_accum=True, gemm_kernel="cublas", gate_up_block=128)
    gate, up = fast.forward_quantized(x8, sx).float().chunk(2, dim=-1)
    exact = (torch.nn.functional.silu(gate) * up)  # from the plain form's [gate | up] output
    m8, sm = fast.swiglu_quantized(x8, sx)
    c8, sc = slow.swiglu_quantized(x8, sx)
    err, cublas_err = rel(m8.float() * sm, exact), rel(c8.float() * sc, exact)
    assert err <= 0.04 and err <= 1.1 * cublas_err + 1e-3, (err, cublas_err)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g8, gs = fast.swiglu_quantized(x8, sx)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g8.float(), m8.float()) and torch.equal(gs, sm)


_HOPPER_BUILD = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor
from engine.kernels import FP_FUSION
from engine.kernels.fp8_gemm import _fp8_gemm_kernel

hopper = GPUTarget("cuda", 90, 32)
def desc(rows, cols, block, dtype=torch.float8_e4m3fn):
    return mangle_type(TensorDescriptor.from_tensor(torch.zeros(rows, cols, dtype=dtype), list(block)))
const = lambda *names: {n: "constexpr" for n in names}
builds = []
# the launcher's defaults and FP8Linear's plain form where outputs tile in 256, at the 57b shard's tiles
for swiglu, block_n, stages, pdl in ((False, 128, 4, False), (False, 256, 3, False), (True, 128, 3, False), (False, 256, 3, True), (True, 128, 3, True)):
    sig = {"x_desc": desc(256, 256, (128, 128)), "w_desc": desc(512, 256, (2 * block_n if swiglu else block_n, 128)),
           "y_desc": desc(256, 512, (128, block_n), torch.bfloat16), "sx": "*fp32", "sw": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           **const("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PROGRAMS", "SWIGLU", "PROMOTE_EVERY", "EXACT", "PDL")}
    values = dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, PROGRAMS=132, SWIGLU=swiglu, PROMOTE_EVERY=None, EXACT=False,
                  PDL=pdl)
    builds.append((pdl, triton.compile(ASTSource(_fp8_gemm_kernel, sig, constexprs=values), target=hopper,
                                       options={"num_warps": 8, "num_stages": stages, **FP_FUSION,
                                                **({"launch_pdl": True} if pdl else {})})))
for pdl, built in builds:
    ptx = built.asm["ptx"]
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx, built.name
    # with PDL each program waits for the previous kernel before its first TMA load
    assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx, built.name
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor"), built.name
    assert built.metadata.shared <= 232448, (built.name, built.metadata.shared)  # an H100/H200 block's shared memory
print("built")
"""


def test_the_gemm_kernel_builds_for_hopper():
    """The GEMM kernel compiles for sm_90a in both forms with the launcher's tiles (TMA descriptors, wgmma, the
    flattened tile loop) and fits a block's shared memory, on any machine (ptxas ships with Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("built"), out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs a Hopper GPU")
def test_block_linears_on_the_triton_gemm_track_cublas_through_a_session():
    """As served on Hopper where the outputs tile (this spec's do): all four block linears on the Triton FP8 GEMM, the
    out-projection reading the attention's e4m3 output; against the same weights with every product on cuBLAS."""
    import copy

    from engine.fused_block import apply_fp8_kernels
    from engine.kernels.fp8_linear import BLOCK_LINEARS

    model = kernel_model()
    served = apply_fp8_kernels(copy.deepcopy(model), fuse=True, fast_accum=True)
    assert {getattr(served.blocks[0], n).gemm_kernel for n in BLOCK_LINEARS} == {"triton"}
    cublas = apply_fp8_kernels(model, fuse=True, fast_accum=True, gemm_kernels=dict.fromkeys(BLOCK_LINEARS, "cublas"))
    kw = dict(cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    fast, slow = run_session(served, 8, **kw), run_session(cublas, 8, **kw)
    rel = ((fast.float() - slow.float()).norm() / slow.float().norm()).item()
    assert rel <= 1e-2, rel
