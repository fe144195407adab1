"""Model specs: every shape the engine knows, in one place.

One *step* makes one latent frame (= `frames_per_latent` video frames) in `passes`
denoising passes. Each pass runs every block over the new frame's tokens (video
tokens + audio tokens) attending to the KV cache: `sink_slots` reference slots
plus a ring of `window_frames` frame slots (the newest of which is the frame being
made). So one attention call reads `cache_slots` slots, `frame_tokens` of them new.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dim: int
    n_heads: int
    n_blocks: int
    mlp_hidden: int  # SwiGLU hidden width
    latent_channels: int
    latent_grid: tuple[int, int]  # (h, w) of one latent frame
    patch: int  # latent pixels per token side
    audio_tokens: int  # audio tokens per latent frame
    reference_grid: tuple[int, int]  # token grid of the reference (sink) frame
    sink_slots: int  # >= reference tokens; the rest stay masked (padding for kernel tiles)
    window_frames: int  # ring frames, the frame being made included
    passes: int = 4
    reset_every: int = 42  # temporal positions go back by this many frames every so many steps
    reference_distance: int = 0  # frames between the sink and the newest frame (0 = window_frames)
    frames_per_latent: int = 4
    fps: int = 24
    image_size: tuple[int, int] = (256, 256)  # decoded RGB frame (h, w)
    n_mels: int = 32
    audio_context: int = 2  # video frames of audio either side of a latent frame's 4
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"spec {self.name}: dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"spec {self.name}: head_dim {self.head_dim} must be even for RoPE")
        h, w = self.latent_grid
        if h % self.patch or w % self.patch:
            raise ValueError(f"spec {self.name}: latent_grid {self.latent_grid} not divisible by patch {self.patch}")
        if self.sink_slots < self.reference_tokens:
            raise ValueError(
                f"spec {self.name}: sink_slots {self.sink_slots} < reference tokens {self.reference_tokens}"
            )
        if self.window_frames < 1 or self.passes < 1:
            raise ValueError(f"spec {self.name}: window_frames and passes must be >= 1")

    def reset_interval(self, override: int | None = None) -> int:
        """Steps between position resets: `override` where a session gives one, else this spec's (0: never)."""
        return self.reset_every if override is None else override

    # Derived shapes ----------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def token_grid(self) -> tuple[int, int]:
        h, w = self.latent_grid
        return h // self.patch, w // self.patch

    @property
    def video_tokens(self) -> int:
        gh, gw = self.token_grid
        return gh * gw

    @property
    def frame_tokens(self) -> int:
        return self.video_tokens + self.audio_tokens

    @property
    def reference_tokens(self) -> int:
        return self.reference_grid[0] * self.reference_grid[1]

    @property
    def cache_slots(self) -> int:
        return self.sink_slots + self.window_frames * self.frame_tokens

    @property
    def patch_dim(self) -> int:
        return self.latent_channels * self.patch * self.patch

    @property
    def audio_window(self) -> int:
        """Video frames of audio features one latent frame is conditioned on."""
        return self.frames_per_latent + 2 * self.audio_context

    @property
    def sink_distance(self) -> int:
        """Temporal distance from the newest frame to the reference, fixed for the session."""
        return self.reference_distance or self.window_frames

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Head dims rotated by (time, height, width); each even, time takes the remainder."""
        spatial = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * spatial, spatial, spatial

    @property
    def step_seconds(self) -> float:
        return self.frames_per_latent / self.fps

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)


SPECS: dict[str, ModelSpec] = {
    # For tests: runs thousands of steps on a CPU in seconds. Two sink slots of padding
    # keep the masked-slot path exercised.
    "tiny": ModelSpec(
        name="tiny", dim=64, n_heads=4, n_blocks=2, mlp_hidden=128, latent_channels=4,
        latent_grid=(4, 4), patch=1, audio_tokens=2, reference_grid=(4, 4), sink_slots=18,
        window_frames=3, reset_every=5, image_size=(32, 32), n_mels=16, audio_context=1,
    ),
    # The shipped character: 256 video tokens a latent frame, real time on one GPU.
    "demo": ModelSpec(
        name="demo", dim=384, n_heads=6, n_blocks=8, mlp_hidden=1024, latent_channels=16,
        latent_grid=(16, 16), patch=1, audio_tokens=4, reference_grid=(16, 16), sink_slots=256,
        window_frames=6, image_size=(256, 256),
    ),
    # The shipped character for CPUs: 64 video tokens a latent frame, a narrower DiT and 128x128 frames, about
    # a seventh of the demo's work a step, so that a few cores hold real time.
    "demo-cpu": ModelSpec(
        name="demo-cpu", dim=256, n_heads=4, n_blocks=6, mlp_hidden=640, latent_channels=16,
        latent_grid=(8, 8), patch=1, audio_tokens=4, reference_grid=(8, 8), sink_slots=64,
        window_frames=6, image_size=(128, 128),
    ),
    # The seed's production shape, random weights, for benchmarks: 60 blocks, 4 passes,
    # 748 video tokens (704x1088 video, 16x VAE, 2x2 patches) + 9 audio tokens = 757 new
    # tokens a pass; 489 sink slots + 7 ring frames x 757 = 5,788 slots read per call.
    # 60 heads of 128 split evenly at tensor-parallel degree 2, 3 and 4.
    "characters-57b": ModelSpec(
        name="characters-57b", dim=7680, n_heads=60, n_blocks=60, mlp_hidden=24576,
        latent_channels=16, latent_grid=(44, 68), patch=2, audio_tokens=9,
        reference_grid=(18, 27), sink_slots=489, window_frames=7, image_size=(704, 1088),
    ),
}


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown spec {name!r}; known specs: {', '.join(SPECS)}") from None


def shard_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The shape one tensor-parallel rank holds: heads and MLP split `tp` ways."""
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    if spec.n_heads % tp or spec.mlp_hidden % tp:
        raise ValueError(f"spec {spec.name}: tensor-parallel degree {tp} must divide n_heads {spec.n_heads} and mlp_hidden {spec.mlp_hidden}")
    return replace(spec, dim=spec.dim // tp, n_heads=spec.n_heads // tp, mlp_hidden=spec.mlp_hidden // tp)
