"""The demo character: a procedural face whose mouth follows the audio.

Everything is drawn from signed distance functions on the pixel grid, batched over
frames, so one call renders a whole clip on the CPU or the GPU:

    frames, state = render_audio(pcm, "ada", seed=0)   # (T, H, W, 3) uint8, (T, STATE) float

A *look* (face shape, colours, hair, eyes) is a flat float vector so a batch can
mix characters; `PRESETS` holds the named ones, `random_look` makes new ones for
training. The per-frame *state* (head sway, tilt, blink, gaze, mouth opening and
roundness, brows, smile) is the ground truth the clip was drawn from: idle motion comes
from a seed, the mouth from the audio's log-mel features (loudness opens it, the low/high
band balance rounds or widens it), listening motion from the user's voice (`listen`).
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

import numpy as np
import torch

from engine.audio import SAMPLE_RATE
from engine.mel import log_mel_frames, mel_filterbank

RENDER_MELS = 32  # the mouth reads its own 32-band log-mel, whatever the model spec's n_mels
LOUD_DB = (10.0, 36.0)  # frame loudness (dB of summed mel power) mapped to mouth opening 0 .. 1
LOW_HZ, HIGH_HZ = 1000.0, 2500.0  # bands below / above these form the spectral shape cue

# Fixed colours: the mouth interior is the darkest thing on every face, which the
# lip-sync metric relies on.
MOUTH_DARK = (0.20, 0.04, 0.07)
TEETH = (0.95, 0.94, 0.90)
TONGUE = (0.80, 0.34, 0.40)
EYE_WHITE = (0.97, 0.97, 0.97)
PUPIL = (0.05, 0.04, 0.05)


@dataclass(frozen=True)
class Look:
    """One character. Lengths are in units of half the image height; y points down."""

    bg_top: tuple[float, float, float]
    bg_bottom: tuple[float, float, float]
    skin: tuple[float, float, float]
    hair: tuple[float, float, float]
    iris: tuple[float, float, float]
    lips: tuple[float, float, float]
    shirt: tuple[float, float, float]
    face_rx: float = 0.50
    face_ry: float = 0.62
    jaw: float = 0.4  # 0 = oval, 1 = pointed chin
    head_y: float = -0.05
    eye_y: float = -0.10
    eye_dx: float = 0.19
    eye_rx: float = 0.085
    eye_ry: float = 0.060
    brow_lift: float = 0.09
    brow_thick: float = 0.018
    mouth_y: float = 0.30
    mouth_w: float = 0.145
    hair_top: float = 0.10  # hair volume above the face
    hair_long: float = 0.0  # how far hair falls below the head centre (0 = short)
    fringe: float = 0.5  # 0 = forehead bare, 1 = fringe down to the brows
    hair_wave: float = 0.5
    ears: float = 1.0
    blush: float = 0.25

    def vector(self) -> torch.Tensor:
        out: list[float] = []
        for v in astuple(self):
            out.extend(v if isinstance(v, tuple) else (v,))
        return torch.tensor(out, dtype=torch.float32)


_COLOUR_FIELDS = ("bg_top", "bg_bottom", "skin", "hair", "iris", "lips", "shirt")


def _look_index() -> tuple[dict[str, slice], int]:
    """Where each field sits in the flat look vector, and its length."""
    index, i = {}, 0
    for f in fields(Look):
        n = 3 if f.name in _COLOUR_FIELDS else 1
        index[f.name] = slice(i, i + n)
        i += n
    return index, i


LOOK_INDEX, LOOK_SIZE = _look_index()

STATE_FIELDS = ("dx", "dy", "tilt", "blink", "gaze_x", "gaze_y", "open", "round", "brow", "smile")
STATE_SIZE = len(STATE_FIELDS)
S = {name: i for i, name in enumerate(STATE_FIELDS)}

PRESETS: dict[str, Look] = {
    "ada": Look(
        bg_top=(0.55, 0.72, 0.92), bg_bottom=(0.30, 0.45, 0.75), skin=(0.98, 0.82, 0.70),
        hair=(0.42, 0.24, 0.12), iris=(0.20, 0.55, 0.35), lips=(0.85, 0.42, 0.45), shirt=(0.95, 0.80, 0.25),
        face_rx=0.48, face_ry=0.60, jaw=0.35, hair_top=0.12, hair_long=0.35, fringe=0.6, hair_wave=0.3,
    ),
    "kofi": Look(
        bg_top=(0.98, 0.78, 0.45), bg_bottom=(0.90, 0.50, 0.25), skin=(0.55, 0.35, 0.24),
        hair=(0.08, 0.06, 0.06), iris=(0.30, 0.18, 0.08), lips=(0.45, 0.20, 0.18), shirt=(0.20, 0.45, 0.70),
        face_rx=0.52, face_ry=0.60, jaw=0.15, hair_top=0.07, hair_long=0.0, fringe=0.15, hair_wave=0.9,
        eye_rx=0.08, mouth_w=0.155, brow_thick=0.024,
    ),
    "mika": Look(
        bg_top=(0.55, 0.85, 0.80), bg_bottom=(0.25, 0.55, 0.55), skin=(1.00, 0.88, 0.82),
        hair=(0.78, 0.38, 0.70), iris=(0.35, 0.25, 0.60), lips=(0.92, 0.45, 0.55), shirt=(0.98, 0.96, 0.92),
        face_rx=0.45, face_ry=0.64, jaw=0.55, hair_top=0.14, hair_long=0.65, fringe=0.85, hair_wave=0.1,
        eye_rx=0.095, eye_ry=0.068, mouth_w=0.13, blush=0.4,
    ),
    "sol": Look(
        bg_top=(0.70, 0.60, 0.88), bg_bottom=(0.40, 0.30, 0.62), skin=(0.86, 0.64, 0.46),
        hair=(0.85, 0.38, 0.12), iris=(0.20, 0.35, 0.65), lips=(0.72, 0.34, 0.30), shirt=(0.25, 0.60, 0.35),
        face_rx=0.50, face_ry=0.58, jaw=0.25, hair_top=0.18, hair_long=0.05, fringe=0.35, hair_wave=0.7,
        mouth_w=0.14, ears=0.8, blush=0.15,
    ),
}


def get_look(preset: str | Look) -> Look:
    if isinstance(preset, Look):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}") from None


def random_look(seed: int) -> Look:
    """A new character: a named preset's proportions jittered, colours drawn afresh."""
    rng = np.random.default_rng(seed)
    base = PRESETS[sorted(PRESETS)[rng.integers(len(PRESETS))]]

    def colour(lo: float, hi: float) -> tuple[float, float, float]:
        return tuple(float(c) for c in rng.uniform(lo, hi, 3))

    skin_l = rng.uniform(0.45, 1.0)
    skin = tuple(float(np.clip(skin_l * k, 0, 1)) for k in (1.0, rng.uniform(0.72, 0.88), rng.uniform(0.55, 0.75)))
    lips = tuple(float(np.clip(s * k, 0, 1)) for s, k in zip(skin, (0.85, 0.50, 0.55)))

    def jitter(v: float, amount: float) -> float:
        return float(v * (1 + rng.uniform(-amount, amount)))

    return Look(
        bg_top=colour(0.3, 1.0), bg_bottom=colour(0.15, 0.8), skin=skin, hair=colour(0.05, 0.9),
        iris=colour(0.1, 0.7), lips=lips, shirt=colour(0.1, 1.0),
        face_rx=jitter(base.face_rx, 0.08), face_ry=jitter(base.face_ry, 0.06), jaw=float(rng.uniform(0.1, 0.6)),
        head_y=base.head_y, eye_y=jitter(base.eye_y, 0.15), eye_dx=jitter(base.eye_dx, 0.08),
        eye_rx=jitter(base.eye_rx, 0.12), eye_ry=jitter(base.eye_ry, 0.12), brow_lift=jitter(base.brow_lift, 0.15),
        brow_thick=jitter(base.brow_thick, 0.25), mouth_y=jitter(base.mouth_y, 0.05), mouth_w=jitter(base.mouth_w, 0.12),
        hair_top=float(rng.uniform(0.04, 0.2)), hair_long=float(rng.choice([0.0, rng.uniform(0.0, 0.7)])),
        fringe=float(rng.uniform(0.1, 0.9)), hair_wave=float(rng.uniform(0, 1)), ears=float(rng.uniform(0.6, 1.0)),
        blush=float(rng.uniform(0.0, 0.4)),
    )


def look_vectors(looks: list[str | Look] | str | Look) -> torch.Tensor:
    """Presets or looks -> (N, LOOK_SIZE)."""
    if isinstance(looks, (str, Look)):
        looks = [looks]
    return torch.stack([get_look(x).vector() for x in looks])


# Audio -> mouth ---------------------------------------------------------------------
_BANDS: dict[str, torch.Tensor] = {}


def _band_masks() -> tuple[torch.Tensor, torch.Tensor]:
    if not _BANDS:
        centres = mel_filterbank(RENDER_MELS).argmax(1).float() * (SAMPLE_RATE / 2) / (mel_filterbank(RENDER_MELS).shape[1] - 1)
        _BANDS["low"] = (centres < LOW_HZ).float()
        _BANDS["high"] = (centres > HIGH_HZ).float()
    return _BANDS["low"], _BANDS["high"]


def mouth_from_features(features: torch.Tensor) -> torch.Tensor:
    """Per-frame 32-band log-mel features (T, 32) -> mouth (T, 2): opening and roundness in [0, 1].

    Opening follows loudness (dB of the summed mel power), smoothed over the frame and its
    two neighbours (so a frame's mouth needs audio only one frame either side). Roundness
    is the low/high band balance: vowel-heavy frames round the mouth, hiss widens it.
    """
    if features.ndim != 2 or features.shape[1] != RENDER_MELS:
        raise ValueError(f"mouth features must be (frames, {RENDER_MELS}), got {tuple(features.shape)}")
    if not torch.isfinite(features).all():
        raise ValueError("mouth features contain NaN or infinite values")
    mel = (10.0 ** (4.0 * features.double() - 4.0) - 1e-6).clamp(min=0.0)  # undo engine.mel's scaling
    low, high = (m.to(mel) for m in _band_masks())
    loud = 10.0 * torch.log10(mel.sum(1) + 1e-10)
    open_ = ((loud - LOUD_DB[0]) / (LOUD_DB[1] - LOUD_DB[0])).clamp(0.0, 1.0) ** 0.8
    tilt = torch.log10((mel @ low + 1e-9) / (mel @ high + 1e-9))
    round_ = torch.sigmoid((tilt - 1.0) * 1.5)
    round_ = 0.5 + (round_ - 0.5) * open_.clamp(max=0.5) * 2  # a closed mouth is neutral
    both = torch.stack([open_, round_], 1)
    padded = torch.cat([both[:1], both, both[-1:]])  # edge frames repeat
    smooth = 0.25 * padded[:-2] + 0.5 * padded[1:-1] + 0.25 * padded[2:]
    return smooth.float()


def audio_features(pcm: np.ndarray | torch.Tensor, n_frames: int | None = None, fps: int = 24) -> torch.Tensor:
    """16 kHz mono PCM -> the renderer's (T, 32) features, one row per video frame."""
    return log_mel_frames(pcm, RENDER_MELS, 0, n_frames, fps)


def mouth_from_audio(pcm: np.ndarray | torch.Tensor, n_frames: int | None = None, fps: int = 24) -> torch.Tensor:
    """16 kHz mono PCM -> mouth (T, 2) per video frame, aligned to engine.audio.frame_sample."""
    feats = audio_features(pcm, n_frames, fps)
    if feats.shape[0] == 0:
        return torch.zeros(0, 2)
    return mouth_from_features(feats)


# Idle motion -------------------------------------------------------------------------
def idle_motion(n_frames: int, seed: int, first_frame: int = 0, fps: int = 24) -> torch.Tensor:
    """Head sway, tilt, blinks and gaze (T, 6) for frames first_frame .. first_frame + n_frames - 1.

    A deterministic function of (seed, absolute frame): any stretch of a session can be
    drawn on its own and matches the same stretch drawn as part of a longer one.
    """
    if n_frames < 0 or first_frame < 0:
        raise ValueError(f"n_frames and first_frame must be >= 0, got {n_frames}, {first_frame}")
    rng = np.random.default_rng([seed, 1234])
    t = (first_frame + np.arange(n_frames)) / fps  # seconds

    def sway(amplitude: float, k: int) -> np.ndarray:
        freqs = rng.uniform(0.08, 0.35, k)
        phases = rng.uniform(0, 2 * math.pi, k)
        weights = rng.uniform(0.5, 1.0, k)
        weights = weights / weights.sum()
        return amplitude * (weights[:, None] * np.sin(2 * math.pi * freqs[:, None] * t[None] + phases[:, None])).sum(0)

    dx, dy, tilt = sway(0.035, 3), sway(0.018, 3), sway(0.05, 2)
    gx, gy = sway(0.5, 2), sway(0.3, 2)
    # Blinks: onsets 1.5 .. 5.5 s apart, each ~170 ms (close fast, open slower).
    blink = np.zeros(n_frames)
    end = (first_frame + n_frames) / fps
    onset = rng.uniform(0.5, 3.0)
    shape = np.array([0.5, 1.0, 1.0, 0.6, 0.25])
    while onset < end + 1:
        f0 = round(onset * fps) - first_frame
        for i, b in enumerate(shape):
            if 0 <= f0 + i < n_frames:
                blink[f0 + i] = max(blink[f0 + i], b)
        onset += rng.uniform(1.5, 5.5)
    return torch.from_numpy(np.stack([dx, dy, tilt, blink, gx, gy], 1)).float()


def frame_states(mouth: torch.Tensor, seed: int, first_frame: int = 0, fps: int = 24,
                 listening: torch.Tensor | None = None) -> torch.Tensor:
    """Mouth (T, 2) + the seed's idle motion -> full per-frame state (T, STATE_SIZE); with `listening` (T, 3),
    the rows of the user's voice (engine.listen), the listening motion on top."""
    states = torch.cat([idle_motion(mouth.shape[0], seed, first_frame, fps), mouth.float(),
                        torch.zeros(mouth.shape[0], 2)], 1)
    return states if listening is None else listen(states, listening)


# Listening motion --------------------------------------------------------------------
NOD = 0.03  # head dip (look units) at a full pause
BROW_RAISE = 0.035  # brow lift at full voice
SMILE_LIFT = 0.035  # mouth-corner lift at a full smile
GAZE_HOLD = 0.8  # share of the idle gaze drawn back to the camera while engaged


def listen(states: torch.Tensor, listening: torch.Tensor) -> torch.Tensor:
    """States (..., STATE_SIZE) with the listening motion of rows (..., 3) of the user's voice (engine.listen:
    voice, engaged, pause): a nod just after the user stops, brows up while they speak, mouth corners up and
    eyes to the camera while they have been speaking a while. Silent rows (zeros) change nothing."""
    voice, engaged, pause = listening.to(states).unbind(-1)
    out = states.clone()
    out[..., S["dy"]] = states[..., S["dy"]] + NOD * pause
    out[..., S["brow"]] = states[..., S["brow"]] + voice
    out[..., S["smile"]] = states[..., S["smile"]] + engaged
    hold = 1.0 - GAZE_HOLD * engaged.clamp(0, 1)
    out[..., S["gaze_x"]] = states[..., S["gaze_x"]] * hold
    out[..., S["gaze_y"]] = states[..., S["gaze_y"]] * hold
    return out


def neutral_state(n: int = 1) -> torch.Tensor:
    """Head centred, eyes open, mouth closed: the reference pose (n, STATE_SIZE)."""
    state = torch.zeros(n, STATE_SIZE)
    state[:, S["round"]] = 0.5
    return state


# Drawing -----------------------------------------------------------------------------
def _ellipse(x: torch.Tensor, y: torch.Tensor, rx: torch.Tensor, ry: torch.Tensor) -> torch.Tensor:
    """Approximate signed distance to an axis-aligned ellipse (exact on the axes)."""
    k0 = torch.sqrt((x / rx) ** 2 + (y / ry) ** 2)
    k1 = torch.sqrt((x / rx**2) ** 2 + (y / ry**2) ** 2)
    return k0 * (k0 - 1.0) / k1.clamp(min=1e-6)


def _over(img: torch.Tensor, colour: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Paint colour (N, 3) or (N, 3, H, W) over img (N, 3, H, W) with coverage alpha (N, H, W)."""
    if colour.ndim == 2:
        colour = colour[:, :, None, None]
    a = alpha.unsqueeze(1)
    return img + (colour - img) * a


def render(looks: torch.Tensor, states: torch.Tensor, size: tuple[int, int] = (256, 256)) -> torch.Tensor:
    """Looks (N, LOOK_SIZE) and states (N, STATE_SIZE) -> frames (N, 3, H, W) float in [0, 1].

    Runs on the device of `states`; every op is elementwise over the pixel grid.
    """
    if looks.ndim != 2 or looks.shape[1] != LOOK_SIZE:
        raise ValueError(f"looks must be (N, {LOOK_SIZE}), got {tuple(looks.shape)}")
    if states.ndim != 2 or states.shape[1] != STATE_SIZE:
        raise ValueError(f"states must be (N, {STATE_SIZE}), got {tuple(states.shape)}")
    if looks.shape[0] not in (1, states.shape[0]):
        raise ValueError(f"{looks.shape[0]} looks for {states.shape[0]} states")
    if not (torch.isfinite(looks).all() and torch.isfinite(states).all()):
        raise ValueError("looks or states contain NaN or infinite values")
    h, w = size
    dev = states.device
    states = states.float()
    looks = looks.to(dev).float().expand(states.shape[0], -1)

    def L(name: str) -> torch.Tensor:  # (N, 1, 1) scalar or (N, 3) colour
        v = looks[:, LOOK_INDEX[name]]
        return v if v.shape[1] == 3 else v.view(-1, 1, 1)

    def St(name: str) -> torch.Tensor:
        return states[:, S[name]].view(-1, 1, 1)

    px = 2.0 / h  # one pixel in look units

    def fill(sdf: torch.Tensor) -> torch.Tensor:  # anti-aliased coverage of sdf < 0
        return (0.5 - sdf / px).clamp(0.0, 1.0)

    ys = (torch.arange(h, device=dev, dtype=torch.float32) + 0.5) * px - 1.0
    xs = ((torch.arange(w, device=dev, dtype=torch.float32) + 0.5) * px - w / h)
    gy, gx = ys.view(1, h, 1), xs.view(1, 1, w)

    # Background: vertical gradient with a soft vignette.
    ramp = ((gy + 1.0) / 2.0).unsqueeze(1)  # (1, 1, H, 1)
    img = L("bg_top")[:, :, None, None] * (1 - ramp) + L("bg_bottom")[:, :, None, None] * ramp
    img = img * (1.0 - 0.12 * (gx**2 + gy**2)).unsqueeze(1)
    img = img.expand(states.shape[0], 3, h, w)

    # Head-local coordinates: translate by sway, rotate by tilt.
    cx, cy = St("dx"), L("head_y") + St("dy")
    ct, st = torch.cos(St("tilt")), torch.sin(St("tilt"))
    ux, uy = gx - cx, gy - cy
    x, y = ct * ux + st * uy, -st * ux + ct * uy

    rx, ry = L("face_rx"), L("face_ry")
    skin = L("skin")
    shade = skin * 0.62

    # Shirt and neck follow the head half-way.
    img = _over(img, L("shirt"), fill(_ellipse(gx - 0.5 * cx, gy - 1.32, torch.full_like(cx, 0.78), torch.full_like(cx, 0.52))))
    neck = torch.maximum((gx - 0.5 * cx).abs() - rx * 0.38, (gy - (cy + ry * 0.6)).abs() - 0.35)
    img = _over(img, skin * 0.82, fill(neck))

    # Hair behind the head (long hair falls to hair_long below the centre).
    back = _ellipse(x, y + 0.05, rx * 1.16, ry * 1.02 + L("hair_top"))
    long_ = torch.maximum(x.abs() - rx * 1.18, (y - (L("hair_long") - 0.3) / 2 - 0.15).abs() - (L("hair_long") + 0.3) / 2)
    long_ = torch.where(L("hair_long") > 0.02, long_, torch.full_like(long_, 9.0))
    img = _over(img, L("hair"), fill(torch.minimum(back, long_)))

    # Ears, then the face with a jaw taper and an outline.
    ear = torch.minimum(_ellipse(x - rx * 0.97, y + 0.02, 0.07 * L("ears"), 0.11 * L("ears")),
                        _ellipse(x + rx * 0.97, y + 0.02, 0.07 * L("ears"), 0.11 * L("ears")))
    img = _over(img, skin * 0.9, fill(torch.where(L("ears") > 0.05, ear, torch.full_like(ear, 9.0))))
    taper = 1.0 - L("jaw") * 0.35 * (y.clamp(min=0) / ry) ** 2
    face = _ellipse(x, y, rx * taper, ry)
    img = _over(img, shade, fill(face))
    img = _over(img, skin[:, :, None, None] * (1.0 - 0.10 * (x / rx) ** 2).unsqueeze(1), fill(face + 0.008))

    # Cheeks.
    crx, cry = torch.full_like(rx, 0.075), torch.full_like(rx, 0.045)
    cheek = torch.minimum(_ellipse(x - L("eye_dx") * 1.1, y - L("mouth_y") * 0.45, crx, cry),
                          _ellipse(x + L("eye_dx") * 1.1, y - L("mouth_y") * 0.45, crx, cry))
    blush = (0.5 - cheek / 0.04).clamp(0, 1) * L("blush")
    img = _over(img, torch.tensor([0.95, 0.45, 0.45], device=dev).expand(states.shape[0], 3), blush)

    # Hair cap above a (wavy) fringe line.
    fringe_y = -ry * (0.98 - 0.55 * L("fringe")) + 0.025 * L("hair_wave") * torch.sin(x * 28.0)
    cap = torch.maximum(_ellipse(x, y + 0.06, rx * 1.09, ry * 0.98 + L("hair_top")), y - fringe_y)
    img = _over(img, L("hair"), fill(cap))

    # Brows: arcs above the eyes, thickness brow_thick.
    ey, edx = L("eye_y"), L("eye_dx")
    by = ey - L("brow_lift") - BROW_RAISE * St("brow").clamp(0, 1)
    brow_col = L("hair") * 0.7
    for side in (-1.0, 1.0):
        bx = x - side * edx
        arc = _ellipse(bx, y - by - 0.04, L("eye_rx") * 1.3, torch.full_like(bx[:, :1, :1], 0.07))
        band = torch.maximum(arc.abs() - L("brow_thick") / 2, y - by + 0.005)
        img = _over(img, brow_col, fill(band))

    # Eyes: sclera closes with the blink, iris + pupil follow the gaze, a highlight.
    open_ry = L("eye_ry") * (1.0 - 0.93 * St("blink").clamp(0, 1))
    for side in (-1.0, 1.0):
        ex = x - side * edx
        sclera = _ellipse(ex, y - ey, L("eye_rx"), open_ry)
        img = _over(img, torch.tensor(EYE_WHITE, device=dev).expand(states.shape[0], 3), fill(sclera))
        ix, iy = ex - St("gaze_x") * L("eye_rx") * 0.35, y - ey - St("gaze_y") * L("eye_ry") * 0.3
        r_iris = L("eye_ry") * 0.78
        iris = torch.maximum(torch.sqrt(ix**2 + iy**2) - r_iris, sclera)
        img = _over(img, L("iris"), fill(iris))
        pupil = torch.maximum(torch.sqrt(ix**2 + iy**2) - r_iris * 0.48, sclera)
        img = _over(img, torch.tensor(PUPIL, device=dev).expand(states.shape[0], 3), fill(pupil))
        glint = torch.maximum(torch.sqrt((ix + r_iris * 0.35) ** 2 + (iy + r_iris * 0.35) ** 2) - r_iris * 0.22, sclera)
        img = _over(img, torch.ones(states.shape[0], 3, device=dev), fill(glint))
        lid = sclera.abs() - 0.006
        img = _over(img, shade * 0.55, fill(lid))

    # Nose: a soft shaded arc between eyes and mouth.
    ny = (ey + L("mouth_y")) / 2 + 0.04
    nose = torch.maximum(_ellipse(x, y - ny, torch.full_like(rx, 0.045), torch.full_like(rx, 0.03)).abs() - 0.006, ny - y)
    img = _over(img, shade, fill(nose))

    # Mouth: lips, dark interior whose height follows `open`, teeth and tongue inside it.
    op, rd = St("open").clamp(0, 1), St("round").clamp(0, 1)
    mw = L("mouth_w") * (1.0 + 0.5 * (0.5 - rd) - 0.15 * op * rd)
    mh = 0.007 + op * L("mouth_w") * (0.42 + 0.38 * rd)
    my = y - L("mouth_y") + SMILE_LIFT * St("smile").clamp(0, 1) * (x / mw) ** 2  # corners up with the smile
    upper = torch.where(my < 0, 0.6, 1.0)  # flatter upper lip
    lips = _ellipse(x, my, mw + 0.02, (mh + 0.016) * upper)
    img = _over(img, L("lips"), fill(lips))
    inner = _ellipse(x, my, mw, mh * upper)
    img = _over(img, torch.tensor(MOUTH_DARK, device=dev).expand(states.shape[0], 3), fill(inner))
    teeth = torch.maximum(inner, my + mh * upper * 0.62)
    img = _over(img, torch.tensor(TEETH, device=dev).expand(states.shape[0], 3), fill(teeth) * (op * 2.5 - 0.5).clamp(0, 1))
    tongue = torch.maximum(_ellipse(x, my - mh * 0.85, mw * 0.5, mh * 0.35), inner)
    img = _over(img, torch.tensor(TONGUE, device=dev).expand(states.shape[0], 3), fill(tongue))

    return img.clamp(0.0, 1.0)


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) float in [0, 1] -> (N, H, W, 3) uint8."""
    return (frames.permute(0, 2, 3, 1) * 255.0).round().clamp(0, 255).to(torch.uint8)


def reference_image(preset: str | Look, size: tuple[int, int] = (256, 256), device: str | torch.device = "cpu") -> torch.Tensor:
    """The character's reference picture (H, W, 3) uint8: centred, eyes open, mouth closed."""
    return to_uint8(render(look_vectors(preset), neutral_state(1).to(device), size))[0]


def render_states(preset: str | Look, states: torch.Tensor, size: tuple[int, int] = (256, 256), chunk: int = 64) -> torch.Tensor:
    """One look, states (T, STATE_SIZE) -> frames (T, H, W, 3) uint8, rendered in chunks."""
    look = look_vectors(preset).to(states.device)
    out = [to_uint8(render(look, states[i:i + chunk], size)) for i in range(0, states.shape[0], chunk)]
    return torch.cat(out) if out else torch.zeros(0, *size, 3, dtype=torch.uint8)


def render_audio(pcm: np.ndarray | torch.Tensor, preset: str | Look = "ada", *, seed: int = 0,
                 size: tuple[int, int] = (256, 256), fps: int = 24, n_frames: int | None = None,
                 device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """16 kHz mono PCM -> (frames (T, H, W, 3) uint8, states (T, STATE_SIZE)): the clip and its ground truth."""
    look = get_look(preset)
    states = frame_states(mouth_from_audio(pcm, n_frames, fps), seed, 0, fps).to(device)
    return render_states(look, states, size), states.cpu()
