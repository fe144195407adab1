"""engine/kernels/launch.py and policy.py: the attention kernel's options, programmatic dependent launch, and FMA fusion at
every launch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.helpers import run_session  # noqa: E402
from tests.kernels.shared import DEVICE, kernel_model  # noqa: E402


def test_attention_options_name_their_kernel():
    with pytest.raises(ValueError, match="need the kernel they are for"):
        run_session(kernel_model(), 1, cache="ring", kv_dtype="fp8", backend="triton", attention_options=dict(splits=2))


def test_programmatic_dependent_launch_is_off_without_a_gpu_or_when_turned_off(monkeypatch):
    """PDL needs sm_90 and a CUDA launch: never on the CPU or under the interpreter; TALKLOOP_PDL=0 turns it off."""
    from engine.kernels import PDL_ENV, launch_pdl, pdl_launch

    assert pdl_launch(torch.device("cpu")) == (False, {})
    monkeypatch.setenv(PDL_ENV, "0")
    assert not launch_pdl(DEVICE)


@pytest.mark.gpu
def test_programmatic_dependent_launch_changes_no_step_eager_or_in_the_graph(monkeypatch):
    """The serving configuration with and without PDL (the kernels that take it wait for the one before): the same
    latents bit for bit, eagerly and replayed from the step's graph, and launched with it where this GPU and Triton can."""
    from engine.fused_block import apply_fp8_kernels
    from engine.kernels import PDL_ENV, launch_pdl

    model = apply_fp8_kernels(kernel_model(), fuse=True, branch_streams=True)
    runs = {}
    for pdl in (False, True):
        monkeypatch.setenv(PDL_ENV, "1" if pdl else "0")
        assert launch_pdl(DEVICE) == (pdl and torch.cuda.get_device_capability(DEVICE)[0] >= 9)
        runs[pdl] = [run_session(model, 8, cache="ring", kv_dtype="fp8", backend="triton", cuda_graph=graph)
                     for graph in (False, True)]
    for without, with_pdl in zip(runs[False], runs[True]):
        assert torch.equal(without, with_pdl)


_FUSION_BUILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels.launch import FP_FUSION
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

    kernels_dir = Path(__file__).resolve().parents[2] / "engine" / "kernels"
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
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _FUSION_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    fused, unfused = map(int, out.stdout.split()[-2:])
    assert fused > 0 and unfused == 0, (fused, unfused)
