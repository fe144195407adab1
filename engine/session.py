"""The engine session: a reference frame in, audio features pushed, one latent frame per step.

    session = EngineSession(model, cache="ring", kv_dtype="fp8", seed=0)
    session.start(reference_latent)                 # (C, h, w): the character
    session.push_audio_features(feats)              # (n_frames, n_mels), one row per video frame
    latent = session.step()                         # (C, h, w): video frames 4t .. 4t+3

A caller that keeps the speech itself (`RealtimeCharacter`, which lays it on its own audio
timeline) pushes nothing: it hands each step its window, `session.step(window)`, and the
session holds no copy of it.

Sampling is rectified flow with Euler passes: x_1 is noise, the model predicts the
velocity (noise - data), and `passes` steps walk the noise level from 1 to 0.
"""

from __future__ import annotations

import logging

import torch

from engine import kernels
from engine.cache import ReferenceKVCache, RingKVCache
from engine.mel import silence_features
from engine.model import CausalVideoDiT

CACHES = ("ring", "reference")
BACKENDS = ("auto", "torch", "triton")
log = logging.getLogger("talkloop.session")


def pick_backend(requested: str, device: torch.device, cache: str, kv_dtype: str, reset_every: int) -> str:
    """'auto' takes the Triton kernels where they run (FP8 ring on an FP8-capable GPU), else PyTorch."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "triton" and not kernels.available():
        raise ValueError("the triton backend needs Triton and a CUDA GPU (or TRITON_INTERPRET=1 to run it on the CPU)")
    if requested != "auto":
        return requested
    fast = (cache == "ring" and kv_dtype == "fp8" and reset_every > 0 and kernels.available()
            and kernels.supports_fp8_tensor_cores(device))
    return "triton" if fast else "torch"


def noise_levels(passes: int, shift: float = 1.0) -> list[float]:
    """Noise levels from 1 to 0 (passes + 1 of them); shift > 1 spends more passes at high noise."""
    levels = [1.0 - i / passes for i in range(passes + 1)]
    return [shift * t / (1.0 + (shift - 1.0) * t) for t in levels]


class EngineSession:
    def __init__(
        self,
        model: CausalVideoDiT,
        *,
        cache: str = "ring",
        kv_dtype: str = "fp8",
        reset_every: int | None = None,
        seed: int = 0,
        shift: float = 1.0,
        backend: str = "auto",
        cuda_graph: bool = False,
        attention_options: dict | None = None,
    ):
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        self.model, self.spec = model, model.spec
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.reset_every = self.spec.reset_interval(reset_every)  # steps between position resets (0: never)
        self.backend = pick_backend(backend, self.device, cache, kv_dtype, self.reset_every) if cache == "ring" else "torch"
        if cuda_graph and (self.backend != "triton" or self.device.type != "cuda"):
            raise ValueError("cuda_graph needs the triton backend on a CUDA device")
        self.cuda_graph = cuda_graph
        self._graph: torch.cuda.CUDAGraph | None = None
        if cache == "ring":
            self.cache = RingKVCache(
                self.spec,
                [b.k_norm.weight for b in model.blocks],
                [b.v_norm.weight for b in model.blocks],
                q_gains=[b.q_norm.weight for b in model.blocks],
                kv_dtype=kv_dtype,
                reset_every=reset_every,
                dtype=self.dtype,
                device=self.device,
                backend=self.backend,
                attention_options=attention_options,
            )
        else:
            self.cache = ReferenceKVCache(self.spec, dtype=self.dtype, device=self.device)
        self.levels = torch.tensor(noise_levels(self.spec.passes, shift), dtype=torch.float32, device=self.device)
        # Per pass, the time modulation: a function of the noise schedule and the time weights only (_refresh_modulations)
        self._time_mods: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._time_key: tuple | None = None
        # The parameters time_modulation reads, listed once: the key above follows their storage and versions
        self._time_weights: list[torch.Tensor] | None = None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.steps_done = 0
        self.started = False
        self._silence = silence_features(self.spec.n_mels).to(self.device, self.dtype)
        self._features = torch.empty(0, self.spec.n_mels, device=self.device, dtype=self.dtype)
        self._features_start = -self.spec.audio_context  # video frame of self._features[0]

    @property
    def next_frame(self) -> int:
        """First video frame the next step makes."""
        return self.steps_done * self.spec.frames_per_latent

    @torch.no_grad()
    def start(self, reference_latent: torch.Tensor) -> None:
        """Fill the sink with the reference (character) latent frame (C, h, w)."""
        s = self.spec
        expected = (s.latent_channels, *s.latent_grid)
        if not isinstance(reference_latent, torch.Tensor) or tuple(reference_latent.shape) != expected:
            shape = tuple(reference_latent.shape) if isinstance(reference_latent, torch.Tensor) else type(reference_latent).__name__
            raise ValueError(f"reference latent must have shape {expected} for spec {s.name}, got {shape}")
        if not torch.isfinite(reference_latent).all():
            raise ValueError("reference latent contains NaN or infinite values")
        if self.started:
            raise ValueError("session already started; make a new session for a new character")
        self.model.encode_reference(reference_latent.to(self.device, self.dtype), self.cache.reference_attend)
        self.started = True

    def push_audio_features(self, features: torch.Tensor, start_frame: int | None = None) -> None:
        """Audio features (n, n_mels) for video frames start_frame .. start_frame + n - 1.

        start_frame defaults to the end of what was pushed before (or the next frame to
        make, if that is later). Rows may overwrite frames not yet consumed; frames left
        without features are treated as silence.
        """
        features = torch.as_tensor(features)
        if features.ndim != 2 or features.shape[1] != self.spec.n_mels:
            raise ValueError(f"audio features must have shape (frames, {self.spec.n_mels}), got {tuple(features.shape)}")
        if not torch.isfinite(features).all():
            raise ValueError("audio features contain NaN or infinite values")
        end = self._features_start + self._features.shape[0]
        if start_frame is None:
            start_frame = max(end, self.next_frame)
        first_needed = self.next_frame - self.spec.audio_context
        if start_frame < first_needed:
            raise ValueError(f"audio features for frame {start_frame} arrive too late: frames before {first_needed} are consumed")
        features = features.to(self.device, self.dtype)
        if start_frame > end:  # a gap is silence
            gap = self._silence.expand(start_frame - end, -1)
            self._features = torch.cat([self._features, gap])
            end = start_frame
        offset = start_frame - self._features_start
        keep = self._features[:offset]
        tail = self._features[offset + features.shape[0]:]
        self._features = torch.cat([keep, features, tail])

    def _audio_window(self) -> torch.Tensor:
        """(audio_window, n_mels) features of frames [4t - ctx, 4t + 4 + ctx), silence where missing."""
        n = self.spec.audio_window
        i = self.next_frame - self.spec.audio_context - self._features_start  # the window's first row in the timeline
        # the timeline has no holes (push_audio_features fills gaps with silence): silence, pushed rows, silence
        before = min(max(-i, 0), n)
        pushed = max(0, min(i + n, self._features.shape[0]) - max(i, 0))
        rows = self._features[max(i, 0) : max(i, 0) + pushed]
        if pushed == n:  # all pushed: a view, no copy
            return rows
        return torch.cat([self._silence.expand(before, -1), rows, self._silence.expand(n - before - pushed, -1)])

    def _drop_consumed_features(self) -> None:
        first_needed = self.next_frame - self.spec.audio_context
        drop = max(0, first_needed - self._features_start)
        self._features = self._features[drop:]
        self._features_start += drop

    def _given_window(self, audio: torch.Tensor) -> torch.Tensor:
        """A step's window handed in by the caller, checked and on the session's device and dtype."""
        audio = torch.as_tensor(audio)
        expected = (self.spec.audio_window, self.spec.n_mels)
        if tuple(audio.shape) != expected:
            raise ValueError(f"a step's audio window must have shape {expected} (frames {self.next_frame - self.spec.audio_context} "
                             f"on), got {tuple(audio.shape)}")
        if not torch.isfinite(audio).all():
            raise ValueError("audio features contain NaN or infinite values")
        return audio.to(self.device, self.dtype)

    @torch.no_grad()
    def step(self, audio: torch.Tensor | None = None) -> torch.Tensor:
        """Denoise the next latent frame (C, h, w).

        `audio`: the features (audio_window, n_mels) of this step's window, video frames
        next_frame - audio_context onwards, from a caller that keeps the speech itself;
        without it the window is read from the features pushed by push_audio_features.
        """
        if not self.started:
            raise ValueError("session not started: call start(reference_latent) first")
        audio = self._audio_window() if audio is None else self._given_window(audio)
        self._refresh_modulations()  # here, outside any graph capture; the passes read self._time_mods
        if self.cuda_graph:  # the graph writes the sink's keys itself (from device positions): no launch here
            self.cache.begin_step(self.steps_done, write_sink=False)
            x = self._replay(audio)
        else:
            self.cache.begin_step(self.steps_done)
            x = self._denoise(self._draw_noise().to(self.dtype), audio)
        self.cache.end_step()
        self.steps_done += 1
        self._drop_consumed_features()
        return x

    def _draw_noise(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's starting noise, float32 (C, h, w), from the session's generator: one draw per step, the same
        numbers whether the step runs eagerly or as a graph (`out`: the graph's input buffer)."""
        s = self.spec
        return torch.randn((s.latent_channels, *s.latent_grid), generator=self.generator, device=self.device, out=out)

    def _refresh_modulations(self) -> None:
        """Per pass, model.time_modulation(levels[i]) into self._time_mods: made once, not at every pass of
        every step. The schedule is fixed for the session and the time weights rarely change; on the 57b
        shape its matrix-vector products read about 0.9 GB a pass. Where a time weight changed in place
        since, the same tensors are refilled, so a captured graph reads the new values too."""
        if self._time_weights is None:
            self._time_weights = self.model.time_weights()
        key = tuple((w.data_ptr(), 0 if w.is_inference() else w._version) for w in self._time_weights)
        if key == self._time_key:
            return
        fresh = [self.model.time_modulation(self.levels[i]) for i in range(self.spec.passes)]
        if self._time_mods:
            for kept, made in zip(self._time_mods, fresh):
                for a, b in zip(kept, made):
                    a.copy_(b)
        else:
            self._time_mods = fresh
        self._time_key = key

    def _denoise(self, x: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """All passes of one step (the part a CUDA graph captures)."""
        for i in range(self.spec.passes):
            v = self.model(x, self.levels[i], audio, self.cache.attend, self._time_mods[i])
            x = x + (self.levels[i + 1] - self.levels[i]).to(self.dtype) * v
        return x

    def _graph_body(self) -> torch.Tensor:
        """What the step's CUDA graph runs: the sink's keys at this step's position, then all passes."""
        self.cache.write_sink_keys()
        return self._denoise(self._noise, self._audio)

    def _replay(self, audio: torch.Tensor) -> torch.Tensor:
        """The sink write and the passes as one CUDA graph: static inputs, captured on first use; the step's
        noise is drawn into them here, as the eager step draws it.

        Every pass rewrites the frame's slot and positions come from device tensors
        set by begin_step, so warm-up and capture leave the cache as a plain step would.
        """
        if self._graph is None:
            s = self.spec
            self._noise32 = torch.empty((s.latent_channels, *s.latent_grid), device=self.device)
            self._noise = torch.empty_like(self._noise32, dtype=self.dtype)
            self._audio = torch.empty_like(audio)
        self._noise.copy_(self._draw_noise(out=self._noise32))
        self._audio.copy_(audio)
        if self._graph is None:  # warmed up and captured on this step's inputs
            # timing marks: when the inputs are in, and (recorded inside the graph) when it starts and ends
            self._inputs_in = torch.cuda.Event(enable_timing=True)
            self._graph_marks = tuple(torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._graph_body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._graph_marks[0].record()
                self._out = self._graph_body()
                self._graph_marks[1].record()
            log.info("captured the step's sink write and %d passes in a CUDA graph", self.spec.passes)
        self._inputs_in.record()
        self._graph.replay()
        return self._out.clone()

    def last_graph_times(self) -> dict[str, float] | None:
        """The last step's graph on the GPU's clock, ms: `launch_lag_ms` from its inputs being copied in to its first
        work, `graph_ms` from there to its end; None before a graph step. Waits for that step to finish: call it
        between steps, not inside a loop that must not synchronise."""
        if self._graph is None:
            return None
        self._graph_marks[1].synchronize()
        start, end = self._graph_marks
        return {"launch_lag_ms": self._inputs_in.elapsed_time(start), "graph_ms": start.elapsed_time(end)}
