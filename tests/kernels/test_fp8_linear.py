"""engine/kernels/fp8_linear.py: the row quantisation against quantize_rows_reference, FP8Linear against the
float product (within 5%), its cuBLAS path against the dequantised reference, and cuBLASLt's FP8 product through
ctypes (lab/probes/cublaslt.py) against torch._scaled_mm.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.kernels.fp8_linear import FP8Linear, quantize_rows, quantize_rows_reference  # noqa: E402
from tests.helpers import rel  # noqa: E402
from tests.kernels.shared import DEVICE, close_fp8  # noqa: E402


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_ctypes_product_is_torch_scaled_mm_on_every_configuration_cublaslt_accepts():
    from lab.probes import cublaslt

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    M, K, N = 757, 512, 384  # rows as the 57b frame's: not a multiple of any tile
    x8, sx = quantize_rows_reference(torch.randn(M, K, device=dev, generator=g))
    w8, sw = quantize_rows_reference(torch.randn(N, K, device=dev, generator=g))
    sw = sw.t().contiguous()  # (1, N)
    for fast in (False, True):
        mm = cublaslt.ScaledMatmul(M, K, N, fast_accum=fast)
        mm.bind_scales(sx, sw)
        heuristic = mm.algorithms(4)
        assert heuristic and heuristic[0].rank == 0 and heuristic[0].workspace_bytes == 0
        want = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast)
        assert torch.equal(mm(x8, sx, w8, sw, heuristic[0]), want)
        others = mm.enumerate()
        assert others and all(a.workspace_bytes == 0 for a in others)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        for algo in others:
            assert mm(x8, sx, w8, sw, algo, out) is out
            assert rel(out, want) <= 1e-3, algo.config
    with pytest.raises(ValueError, match="sx must be 757 contiguous float32"):
        mm(x8, sx[:100], w8, sw, heuristic[0])
    with pytest.raises(ValueError, match="takes contiguous x8"):
        mm(x8[:, :256], sx, w8, sw, heuristic[0])
    with pytest.raises(ValueError, match="out must be a contiguous bf16"):
        mm(x8, sx, w8, sw, heuristic[0], out.float())
