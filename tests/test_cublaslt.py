"""cuBLASLt's FP8 product through ctypes (engine/kernels/cublaslt.py): the block GEMMs on tuned configurations
(`FP8Linear.tuned_algorithms`), and the gated residual sum moved into the out-projections' epilogues
(FP8Linear.forward_quantized_add, `block.combine_in_gemm`).

Tolerances: the ctypes product equals torch._scaled_mm's (the same cuBLASLt kernel, bit for bit), and on a tuned
configuration (other tiles) is within 1e-3 of it (relative L2); with the residual
read in the epilogue it is within 1e-2 (relative L2) of the float sum, which rounds once to bf16 as the GPU does;
a block with the sum in the epilogues is within 1e-2 of the block with the sum as its own kernel (both round
the same FP8 products; they differ in where the residual is rounded to bf16).
"""

import copy

import pytest
import torch

pytest.importorskip("triton")

from engine.cache import attention  # noqa: E402
from engine.kernels.fp8_linear import FP8Linear, quantize_linears_, quantize_rows_reference  # noqa: E402
from engine.model import apply_head_norm, build_model  # noqa: E402
from tests.helpers import TINY  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC = TINY if DEVICE.type == "cpu" else TINY.with_(dim=256, n_heads=4, latent_grid=(8, 8), reference_grid=(8, 8), sink_slots=66)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def attend(q, k, v, head_norm=None, fp8_out=False):
    return attention(*apply_head_norm(q, k, v, head_norm))


def _model():
    return build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)


def test_forward_quantized_add_is_the_residual_plus_the_product_under_the_given_column_scales():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.125, generator=g)
    f = FP8Linear(lin.to(DEVICE))
    x8, sx = quantize_rows_reference(torch.randn(40, 64, generator=g).to(DEVICE))
    cols = (torch.rand(48, generator=g) + 0.5).to(DEVICE) * f.weight_scale.reshape(-1)
    residual = torch.randn(40, 48, generator=g).to(DEVICE, torch.bfloat16)
    want = residual.float() + (x8.float() * sx) @ (f.weight8.float() * cols[:, None]).t()
    got = f.forward_quantized_add(x8, sx, cols, residual)
    assert got.dtype == torch.bfloat16 and rel(got, want) <= 1e-2
    into = residual.clone()
    assert f.forward_quantized_add(x8, sx, cols, into, out=into) is into and rel(into, want) <= 1e-2


def test_gate_scales_are_the_gates_times_the_out_projection_weight_scales_and_follow_changes():
    model = quantize_linears_(_model(), fuse=True)
    shared, _ = model.blocks[0].fused_pass
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    for i, block in enumerate(model.blocks):
        gates = (mod + block.modulation)[2:4].float()
        want = gates * torch.cat([block.attn_out.weight_scale, block.mlp_out.weight_scale])
        assert torch.allclose(shared.gate_scales(i, mod), want, rtol=1e-6, atol=0)
    first = shared.gate_scales(0, mod)
    assert shared.gate_scales(1, mod).data_ptr() == first.data_ptr() + first.numel() * 4  # one (L, 2, dim) multiply
    with torch.no_grad():
        model.blocks[1].mlp_out.weight_scale.mul_(2.0)
    gates = (mod + model.blocks[1].modulation)[3].float()
    assert torch.allclose(shared.gate_scales(1, mod)[1], gates * model.blocks[1].mlp_out.weight_scale[0], rtol=1e-6, atol=0)


def test_a_block_with_the_sum_in_the_gemm_epilogues_tracks_the_gated_sum_kernel():
    """Two blocks, then the last block of the model (no next block to hand an input to), each with the gated
    residual sum in its out-projections' epilogues against the same blocks with the sum as its own kernel."""
    model = _model()
    separate = quantize_linears_(copy.deepcopy(model), fuse=True)
    in_gemm = quantize_linears_(copy.deepcopy(model), fuse=True, branch_streams=False)
    for block in in_gemm.blocks:  # on the CPU the reference product and sum (FP8Linear.forward_quantized_add)
        block.combine_in_gemm = True
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SPEC.frame_tokens, SPEC.dim, generator=g).to(DEVICE, next(model.parameters()).dtype)
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    last = len(model.blocks) - 1
    with torch.no_grad():
        want = separate.blocks[1](separate.blocks[0](x, mod, attend), mod, attend)
        y0 = in_gemm.blocks[0](x, mod, attend)
        shared, _ = in_gemm.blocks[0].fused_pass
        assert shared._handover is not None and shared._handover[0] is y0  # the next block's input, made here
        got = in_gemm.blocks[1](y0, mod, attend)
        want_last = separate.blocks[last](x, mod, attend)
        got_last = in_gemm.blocks[last](x, mod, attend)
    assert rel(got, want) <= 1e-2
    assert rel(got_last, want_last) <= 1e-2
    in_gemm.blocks[0].mlp_out = copy.deepcopy(in_gemm.blocks[0].mlp_out)
    with pytest.raises(RuntimeError, match="out-projections were replaced"), torch.no_grad():
        in_gemm.blocks[0](x, mod, attend)


@pytest.mark.gpu
@gpu
def test_the_ctypes_product_is_torch_scaled_mm_and_reads_the_residual_in_its_epilogue():
    from engine.kernels import cublaslt
    from engine.kernels.fp8_linear import cublaslt_runs

    assert cublaslt_runs(0)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    M, K, N = 757, 512, 384  # rows as the 57b frame's: not a multiple of any tile
    x8, sx = quantize_rows_reference(torch.randn(M, K, device=DEVICE, generator=g))
    w8, sw = quantize_rows_reference(torch.randn(N, K, device=DEVICE, generator=g))
    sw = sw.t().contiguous()  # (1, N)
    for fast in (False, True):
        mm = cublaslt.ScaledMatmul(M, K, N, fast_accum=fast)
        mm.bind_scales(sx, sw)
        algo = mm.algorithms(1)[0]
        want = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast)
        assert torch.equal(mm(x8, sx, w8, sw, algo), want)
        residual = torch.randn(M, N, device=DEVICE, generator=g).to(torch.bfloat16)
        exact = residual.float() + (x8.float() * sx) @ (w8.float() * sw.t()).t()
        assert rel(mm(x8, sx, w8, sw, algo, residual=residual), exact) <= 1e-2
        inplace = residual.clone()
        assert rel(mm(x8, sx, w8, sw, algo, out=inplace, residual=inplace), exact) <= 1e-2
    with pytest.raises(ValueError, match="sx must be 757 contiguous float32"):
        mm(x8, sx[:100], w8, sw, algo)
    with pytest.raises(ValueError, match="takes contiguous x8"):
        mm(x8[:, :256], sx, w8, sw, algo)
    with pytest.raises(ValueError, match="residual must be a contiguous bf16"):
        mm(x8, sx, w8, sw, algo, residual=residual.float())


@pytest.mark.gpu
@gpu
def test_the_sum_in_the_epilogues_serves_on_a_gpu_eagerly_and_in_a_cuda_graph():
    """Where cuBLASLt runs it, quantize_linears_ turns it on when asked; the blocks then track the gated-sum kernel's, with the
    MLP branch on its side stream, and replay in a CUDA graph to the eager result."""
    model = _model()
    separate = quantize_linears_(copy.deepcopy(model), fuse=True)
    in_gemm = quantize_linears_(copy.deepcopy(model), fuse=True, combine_in_gemm=True)
    assert all(b.combine_in_gemm and b.branch_streams for b in in_gemm.blocks)
    assert not any(b.combine_in_gemm for b in separate.blocks)  # off unless asked for
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(SPEC.frame_tokens, SPEC.dim, device=DEVICE, generator=g).to(torch.bfloat16)
    mod, _ = model.time_modulation(torch.tensor(0.5, device=DEVICE))
    run = lambda m: m.blocks[1](m.blocks[0](x, mod, attend), mod, attend)
    with torch.no_grad():
        want = run(separate)
        eager = run(in_gemm)
        assert rel(eager, want) <= 1e-2
        graph = torch.cuda.CUDAGraph()
        run(in_gemm)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            got = run(in_gemm)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(got, eager)


@pytest.mark.gpu
@gpu
def test_tuned_configurations_serve_the_57b_shapes_and_give_the_heuristics_product():
    """Each shape in TUNED_ALGORITHMS: cuBLASLt accepts its configuration, and the product matches torch._scaled_mm's
    (other tiles, the same sums to within fast accumulation's rounding); a linear copied after a call works."""
    from engine.kernels.fp8_linear import TUNED_ALGORITHMS

    g = torch.Generator(device=DEVICE).manual_seed(2)
    for (M, K, N), config in TUNED_ALGORITHMS.items():
        lin = torch.nn.Linear(K, N, bias=False, device=DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0.0, K ** -0.5, generator=g)
        f = FP8Linear(lin, fast_accum=True)
        f.tuned_algorithms = True
        x8, sx = quantize_rows_reference(torch.randn(M, K, device=DEVICE, generator=g))
        tuned = f._tuned(M)
        assert tuned is not None and all(tuned[1].config[k] == v for k, v in config.items())
        want = torch._scaled_mm(x8, f.weight8.t(), scale_a=sx, scale_b=f.weight_scale, out_dtype=torch.bfloat16,
                                use_fast_accum=True)
        assert rel(f.forward_quantized(x8, sx), want) <= 1e-3
        assert rel(copy.deepcopy(f).forward_quantized(x8, sx), want) <= 1e-3
        f.tuned_algorithms = False
        assert torch.equal(f.forward_quantized(x8, sx), want)
