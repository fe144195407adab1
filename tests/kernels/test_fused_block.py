"""engine/kernels/fused_block.py's kernels against their PyTorch references, and the fused FP8 block that
launches them (engine/fused_block.py) against the plain block (interpreter on CPU, hardware on GPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from engine import fp8  # noqa: E402
from engine.kernels.fp8_linear import quantize_rows_reference  # noqa: E402
from tests.helpers import run_session  # noqa: E402
from tests.kernels.shared import DEVICE, SPEC, close_fp8, kernel_model  # noqa: E402


def test_fused_fp8_blocks_read_the_ring_kernels_e4m3_attention_output(monkeypatch):
    """The serving block asks the ring for its attention output in e4m3 (no quantisation pass before the
    out-projection); the torch backend answers in bf16 and the block quantises it. Both sessions agree."""
    import copy

    from engine.cache import RingKVCache
    from engine.fused_block import apply_fp8_kernels

    from engine.model import build_model

    model = apply_fp8_kernels(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16), fuse=True)  # as served
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

    from engine.fused_block import apply_fp8_kernels
    from engine.model import build_model

    kw = {"reference": dict(cache="reference"), "ring-torch": dict(cache="ring", kv_dtype="fp8", backend="torch"),
          "ring-triton": dict(cache="ring", kv_dtype="fp8", backend="triton",
                              attention_options=dict(kernel="triton", block_m=16, block_n=16) if DEVICE.type == "cpu" else None)}[cache]
    float32 = apply_fp8_kernels(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.float32), fuse=True)
    bf16 = apply_fp8_kernels(build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16), fuse=True)
    out = run_session(copy.deepcopy(float32), 2, **kw)
    served = run_session(bf16, 2, **kw)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    rel = ((out.float() - served.float()).norm() / served.float().norm()).item()
    assert rel <= 2e-2


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_steps_with_fp8_linears_and_branch_streams():
    """The serving configuration: fused FP8 blocks with the MLP branch on a side stream, captured in the step's graph."""
    from engine.fused_block import apply_fp8_kernels

    model = apply_fp8_kernels(kernel_model(), fuse=True, branch_streams=True)
    assert model.blocks[0].branch_streams
    eager = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton")
    graph = run_session(model, 12, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=True)
    assert torch.equal(eager, graph)


def test_ln_modulate_quant_matches_float_reference():
    from engine.kernels.fused_block import ln_modulate_quant, ln_modulate_quant_reference
    from engine.model import modulate

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(33, 96, generator=g) * 3 + 1).to(DEVICE)
    shift, scale = torch.randn(96, generator=g).to(DEVICE), torch.randn(96, generator=g).to(DEVICE) * 0.3
    h8, sh = ln_modulate_quant(x, shift, scale)
    r8, rs = ln_modulate_quant_reference(x, shift, scale)
    assert torch.allclose(sh, rs, rtol=1e-5)
    close_fp8(h8, r8, rs)
    # the reference is the plain block's LayerNorm and modulation, quantised per row
    plain = modulate(torch.nn.functional.layer_norm(x.float(), (96,), eps=1e-6), shift, scale)
    p8, ps = quantize_rows_reference(plain)
    assert torch.allclose(ps, rs, rtol=1e-6) and torch.equal(p8.view(torch.uint8), r8.view(torch.uint8))


def test_swiglu_quant_and_gated_sum_match_float_reference():
    from engine.kernels.fused_block import gated_sum, gated_sum_reference, swiglu_quant, swiglu_quant_reference

    g = torch.Generator().manual_seed(6)
    gu = torch.randn(29, 2 * 80, generator=g).to(DEVICE)
    m8, sm = swiglu_quant(gu)
    r8, rs = swiglu_quant_reference(gu)
    assert torch.allclose(sm, rs, rtol=1e-5)
    close_fp8(m8, r8, rs)
    gate, up = gu.chunk(2, dim=-1)
    p8, ps = quantize_rows_reference(torch.nn.functional.silu(gate) * up)  # the plain block's SwiGLU, quantised
    assert torch.allclose(ps, rs, rtol=1e-6) and torch.equal(p8.view(torch.uint8), r8.view(torch.uint8))
    a, m, x = (torch.randn(29, 2100, generator=g).to(DEVICE) for _ in range(3))
    ga, gm = torch.randn(2100, generator=g).to(DEVICE), torch.randn(2100, generator=g).to(DEVICE)
    assert torch.allclose(gated_sum(a, m, ga, gm), gated_sum_reference(a, m, ga, gm), atol=1e-5)
    assert torch.allclose(gated_sum(a, m, ga, gm, x), gated_sum_reference(a, m, ga, gm, x), atol=1e-5)
    assert torch.allclose(gated_sum_reference(a, m, ga, gm, x), x + ga * a + gm * m, atol=1e-5)


def test_gated_sum_ln_quant_equals_the_two_kernels_it_replaces():
    from engine.kernels.fused_block import gated_sum, gated_sum_ln_quant, gated_sum_ln_quant_reference, ln_modulate_quant

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
    y_torch, h_torch, s_torch = gated_sum_ln_quant_reference(a, m, ga, gm, x, shift, scale)
    assert torch.allclose(y, y_torch, atol=1e-5) and torch.allclose(sh, s_torch, rtol=1e-5)
    close_fp8(h8, h_torch, s_torch)


def test_a_fused_block_hands_the_next_block_its_input():
    from engine.fused_block import apply_fp8_kernels

    model = apply_fp8_kernels(kernel_model(), fuse=True)
    shared = model.blocks[0].shared
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

    from engine.fused_block import apply_fp8_kernels

    model = kernel_model()
    plain = apply_fp8_kernels(copy.deepcopy(model), fuse=False)
    fused = apply_fp8_kernels(copy.deepcopy(model), fuse=True)
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
    # the stacked norm gains are made once and follow in-place changes of the gains
    from engine.fused_block import FusedBlock, stacked_gains

    block = fused.blocks[0]
    assert isinstance(block, FusedBlock) and not isinstance(plain.blocks[0], FusedBlock)
    assert stacked_gains(block) is stacked_gains(block)
    with torch.no_grad():
        block.k_norm.weight.mul_(2)
    assert torch.equal(stacked_gains(block)[1], block.k_norm.weight)


def test_modulation_tables_are_made_once_a_pass_and_follow_changes():
    from engine.fused_block import FusedPass

    model = kernel_model()
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
    from engine.fused_block import apply_fp8_kernels

    model = kernel_model()
    inline = apply_fp8_kernels(copy.deepcopy(model), fuse=True, branch_streams=False)
    side = apply_fp8_kernels(copy.deepcopy(model), fuse=True, branch_streams=True)
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
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.launch import FP_FUSION
from engine.kernels.fused_block import _gated_sum_kernel, _gated_sum_ln_quant_kernel, _ln_mod_quant_kernel

hopper = GPUTarget("cuda", 90, 32)
rows = {"x": "*bf16", "shift": "*bf16", "scale": "*bf16", "h8": "*fp8e4nv", "sh": "*fp32", "K": "i32", "eps": "fp32",
        "BLOCK_K": "constexpr", "EXACT": "constexpr", "PDL": "constexpr"}
gated = {"a": "*bf16", "m": "*bf16", "ga": "*bf16", "gm": "*bf16", "x": "*bf16", "y": "*bf16", "shift": "*bf16", "scale": "*bf16",
         "h8": "*fp8e4nv", "sh": "*fp32", "K": "i32", "eps": "fp32", "BLOCK_K": "constexpr", "EXACT": "constexpr",
         "PDL": "constexpr"}
plain_sum = {n: gated[n] for n in ("a", "m", "ga", "gm", "x", "y", "K")}
plain_sum.update(HAS_X="constexpr", BLOCK_K="constexpr")
for kernel, sig, const in (*((_ln_mod_quant_kernel, rows, {"BLOCK_K": 8192, "EXACT": False, "PDL": pdl}) for pdl in (False, True)),
                           (_gated_sum_kernel, plain_sum, {"HAS_X": True, "BLOCK_K": 1024}),
                           *((_gated_sum_ln_quant_kernel, gated, {"BLOCK_K": 8192, "EXACT": False, "PDL": pdl}) for pdl in (False, True))):
    pdl = const.get("PDL", False)
    built = triton.compile(ASTSource(kernel, sig, constexprs=const), target=hopper,
                           options={"num_warps": 8, **FP_FUSION, **({"launch_pdl": True} if pdl else {})})
    ptx = built.asm["ptx"]
    assert ".target sm_90" in ptx, kernel
    # with PDL every program waits for the previous kernel before its first load, and none lets the next one launch early
    assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx, (kernel, const)
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), (kernel, const)
print("built")
"""


def test_the_fused_block_kernels_build_for_hopper():
    """The GPU build of the kernels the fused block launches (ptxas ships with Triton): this process runs them in
    the interpreter, so they are compiled in a fresh one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _HOPPER_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("built"), out.stderr[-3000:]
