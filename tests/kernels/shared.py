"""What the kernel tests share: the device, a spec its kernels run at, an FP8 comparison, caches and a model."""

import torch

from engine import fp8
from engine.cache import RingKVCache
from tests.helpers import TINY

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


def kernel_model():
    """A random model of SPEC in the GPU's dtype (bf16), float32 on the CPU."""
    from engine.model import build_model

    return build_model(SPEC, seed=1, device=DEVICE, dtype=torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
