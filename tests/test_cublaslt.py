"""cuBLASLt's FP8 product through ctypes (lab/probes/cublaslt.py), the binding lab/probes/cublaslt_algo_probe.py runs.

Tolerances: on the heuristic's algorithm the product equals torch._scaled_mm's bit for bit (the same cuBLASLt
kernel); on any other configuration cuBLASLt accepts (other tiles and clusters: the same sums in another
order, fast accumulation's rounding) it is within 1e-3 of it (relative L2).
"""

import pytest
import torch

from engine.kernels.fp8_linear import quantize_rows_reference
from tests.helpers import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
