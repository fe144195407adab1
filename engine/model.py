"""The causal video DiT.

One forward pass denoises the newest latent frame: its video tokens and audio tokens
attend to themselves and to the KV cache (the reference sink and the recent frames).
Blocks are *parallel*: attention and MLP read the same modulated input and their
outputs are summed, so under tensor parallelism a block ends in exactly one
all-reduce. Timestep conditioning is adaLN modulation (shift, scale and two gates)
from a shared time projection plus a per-block table.

The model is single-device and batch-free (one session); attention is delegated to
an `attend(layer, q, k, v, head_norm=None, fp8_out=False)` callable so the KV cache (ring or
reference) owns positions, storage and the attention kernel. With `head_norm` (the q, k,
v norm gains stacked (3, H, D) and eps), q, k, v are the block's raw projections and the
attend applies the per-head RMS norms itself: the FP8 ring cache does it inside the
kernel that rotates, quantises and stores them, saving a pass over q, k and v. With
`fp8_out` (asked by the fused FP8 block) an attend may return the output as e4m3 rows with
their scales, ready for the out-projection's FP8 GEMM; the FP8 ring's kernels write it so.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelSpec

# (layer, q, k, v, head_norm=None, fp8_out=False) -> (H, N, D); with fp8_out an attend may return
# (e4m3 (N, H*D), row scales (N, 1)) instead, for the fused block's FP8 out-projection
Attend = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
HeadNorm = tuple[torch.Tensor, float]  # (q, k, v norm gains stacked (3, H, D), eps)


def head_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's dims with gain (H, D): x (..., H, N, D), computed in float32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * gain.float().unsqueeze(-2)).to(x.dtype)


def apply_head_norm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    head_norm: HeadNorm | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an attend does first when handed raw q, k, v with their norm gains; identity without."""
    if head_norm is None:
        return q, k, v
    gains, eps = head_norm
    return tuple(head_rms_norm(x, g, eps) for x, g in zip((q, k, v), gains.unbind(0)))


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's dims with a per-head gain (H, D).

    Bounds every element of q, k, v by max|gain| * sqrt(D): the FP8 cache's static scales.
    """

    def __init__(self, n_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., H, N, D)
        return head_rms_norm(x, self.weight, self.eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class Block(nn.Module):
    """One parallel block, single-device. Speed-ups replace it from outside with a subclass built on its own
    parts (`share_parts`): engine/parallel.py's tensor-parallel block, engine/fused_block.py's fused FP8 block."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.norm = nn.LayerNorm(spec.dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(spec.dim, 3 * spec.dim, bias=False)
        self.q_norm = HeadRMSNorm(spec.n_heads, spec.head_dim)
        self.k_norm = HeadRMSNorm(spec.n_heads, spec.head_dim)
        self.v_norm = HeadRMSNorm(spec.n_heads, spec.head_dim)
        self.attn_out = nn.Linear(spec.dim, spec.dim, bias=False)
        self.mlp_in = nn.Linear(spec.dim, 2 * spec.mlp_hidden, bias=False)  # gate and up, fused
        self.mlp_out = nn.Linear(spec.mlp_hidden, spec.dim, bias=False)
        self.modulation = nn.Parameter(torch.randn(4, spec.dim) / math.sqrt(spec.dim))

    def forward(self, x: torch.Tensor, mod: torch.Tensor, attend: Callable) -> torch.Tensor:
        # x (..., N, dim); mod (4, dim) for one noise level, or (4, ..., N, dim) per token
        table = self.modulation.view(4, *([1] * (mod.ndim - 2)), -1)
        shift, scale, gate_attn, gate_mlp = (mod + table).unbind(0)
        h = modulate(self.norm(x), shift, scale)
        qkv = self.qkv(h).unflatten(-1, (3, -1, self.head_dim)).transpose(-3, -4)  # (..., 3, N, H, D); H local to a rank
        q, k, v = qkv.transpose(-2, -3).unbind(-4)  # 3x (..., H, N, D)
        a = attend(self.q_norm(q), self.k_norm(k), self.v_norm(v))  # (..., H, N, D)
        a = self.attn_out(a.transpose(-2, -3).flatten(-2))
        gate, up = self.mlp_in(h).chunk(2, dim=-1)
        return x + self.combine(a, F.silu(gate) * up, gate_attn, gate_mlp)

    def combine(self, a: torch.Tensor, s: torch.Tensor, gate_attn: torch.Tensor, gate_mlp: torch.Tensor) -> torch.Tensor:
        """gate_attn * a + gate_mlp * mlp_out(s): the block's output before the residual. A tensor-parallel
        block (engine/parallel.py) sums it over the ranks here: the block's one all-reduce."""
        return gate_attn * a + gate_mlp * self.mlp_out(s)


def share_parts(new: Block, block: Block) -> Block:
    """Make `new` (a Block subclass's instance, its nn.Module state not yet set up) hold `block`'s own submodules,
    parameters and buffers: the same objects, no copies. What a swap function builds its replacement block on."""
    nn.Module.__init__(new)
    new.head_dim = block.head_dim
    for name, child in block.named_children():
        new.add_module(name, child)
    for name, param in block.named_parameters(recurse=False):
        new.register_parameter(name, param)
    for name, buffer in block.named_buffers(recurse=False):
        new.register_buffer(name, buffer)
    new.train(block.training)
    return new


def timestep_embedding(noise_level: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of noise levels in [0, 1] -> (..., dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32, device=noise_level.device) / half)
    args = (noise_level.float() * 1000.0).unsqueeze(-1) * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class CausalVideoDiT(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        d = spec.dim
        self.patch_embed = nn.Linear(spec.patch_dim, d)
        self.audio_embed = nn.Linear(spec.audio_window * spec.n_mels, spec.audio_tokens * d)
        self.reference_embed = nn.Parameter(torch.zeros(d))  # marks sink tokens as the reference
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 4 * d))
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_blocks))
        self.head_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.head_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.head = nn.Linear(d, spec.patch_dim)

    # Tokens ------------------------------------------------------------------
    def patchify(self, latent: torch.Tensor) -> torch.Tensor:
        """(..., C, h, w) -> (..., gh*gw, C*p*p)"""
        p = self.spec.patch
        *lead, c, h, w = latent.shape
        x = latent.reshape(*lead, c, h // p, p, w // p, p)
        x = x.permute(*range(len(lead)), -4, -2, -5, -3, -1)  # (..., gh, gw, C, p, p)
        return x.reshape(*lead, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """(..., gh*gw, C*p*p) -> (..., C, h, w)"""
        p, c = self.spec.patch, self.spec.latent_channels
        gh, gw = self.spec.token_grid
        lead = tokens.shape[:-2]
        x = tokens.reshape(*lead, gh, gw, c, p, p)
        x = x.permute(*range(len(lead)), -3, -5, -2, -4, -1)  # (..., C, gh, p, gw, p)
        return x.reshape(*lead, c, gh * p, gw * p)

    def frame_tokens(self, latent: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Noisy latent (..., C, h, w) + audio features (..., audio_window, n_mels) -> (..., frame_tokens, dim)."""
        video = self.patch_embed(self.patchify(latent))
        audio = self.audio_embed(audio.flatten(-2)).unflatten(-1, (self.spec.audio_tokens, self.spec.dim))
        return torch.cat([video, audio], dim=-2)

    def reference_tokens(self, reference_latent: torch.Tensor) -> torch.Tensor:
        """Clean reference latent (C, h, w) -> (reference_tokens, dim) on the reference grid."""
        rh, rw = self.spec.reference_grid
        if (rh, rw) != self.spec.token_grid:
            p = self.spec.patch
            reference_latent = F.interpolate(reference_latent[None], size=(rh * p, rw * p), mode="area")[0]
        return self.patch_embed(self.patchify(reference_latent)) + self.reference_embed

    def time_modulation(self, noise_level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise level () or per token (..., N) -> block modulation (4, ..., dim) and head modulation (2, ..., dim)."""
        t = self.time_mlp(timestep_embedding(noise_level, self.spec.dim).to(self.head.weight.dtype))
        block = self.time_proj(t).unflatten(-1, (4, self.spec.dim)).movedim(-2, 0)
        head = self.head_mod(t).unflatten(-1, (2, self.spec.dim)).movedim(-2, 0)
        return block, head

    def time_weights(self) -> list[torch.Tensor]:
        """The parameters time_modulation reads."""
        return [*self.time_mlp.parameters(), *self.time_proj.parameters(), *self.head_mod.parameters()]

    # Passes ------------------------------------------------------------------
    def run_blocks(self, x: torch.Tensor, noise_level: torch.Tensor, attend: Attend,
                   modulation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`modulation`: time_modulation(noise_level), when the caller made it already."""
        mod, head_mod = modulation if modulation is not None else self.time_modulation(noise_level)
        for i, block in enumerate(self.blocks):
            x = block(x, mod, partial(attend, i))
        shift, scale = head_mod.unbind(0)
        return self.head(modulate(self.head_norm(x), shift, scale))

    def forward(self, latent: torch.Tensor, noise_level: torch.Tensor, audio: torch.Tensor, attend: Attend,
                modulation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One pass: noisy latent (C, h, w) at noise_level () -> velocity (C, h, w)."""
        x = self.frame_tokens(latent, audio)
        out = self.run_blocks(x, noise_level, attend, modulation)
        return self.unpatchify(out[..., : self.spec.video_tokens, :])

    def encode_reference(self, reference_latent: torch.Tensor, attend: Attend) -> None:
        """Run the clean reference through the blocks; `attend` stores each layer's K/V as the sink."""
        x = self.reference_tokens(reference_latent)
        zero = torch.zeros((), device=x.device)
        self.run_blocks(x, zero, attend)


def count_parameters(spec: ModelSpec) -> int:
    """Parameters of a model of this spec, counted without allocating it."""
    with torch.device("meta"):
        return sum(p.numel() for p in CausalVideoDiT(spec).parameters())


def build_model(spec: ModelSpec, *, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CausalVideoDiT:
    """A model with deterministic random weights (checkpoints overwrite them)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CausalVideoDiT(spec)
    return model.to(device=device, dtype=dtype).eval()
