"""Lip sync, measured from the pictures: how well the mouth in the frames follows the audio.

    python -m lab.quality lipsync --spec demo --audio speech.wav --json
    python -m lab.quality lipsync --spec demo --audio speech.wav --minutes 10 --json   # long session
    python -m lab.quality sheet --spec demo --audio speech.wav --presets ada,kofi --out docs/contact.png
    python -m lab.quality compare --a reference --b fp8-cache --clips 8 --json                # a numerics change
    python -m lab.quality drift --spec demo --minutes 10 --json                                 # first vs last minute
    python -m lab.quality idle --spec demo-cpu --seconds 60 --json                              # silence: motion, blinks
    python -m lab.quality listen --spec demo-cpu --audio data/eval.wav --sheet docs/listen.png --json  # the user speaks

The mouth opening of each frame is read from the pixels: the character's geometry is
known (engine.character), so a box that holds the mouth at every head position is
cut out and its darkness relative to the surrounding skin is summed (the mouth's
inside is the darkest thing on every face; a blurred mouth keeps its summed
darkness). The audio envelope is each frame's own loudness (RMS, dBFS).

Scores follow SyncNet's LSE-C/LSE-D: the Pearson correlation of mouth and envelope at
every offset within +-max_offset frames; `confidence` is the best correlation minus
the median over offsets (LSE-C), `best_offset` where it peaks, and the headline
`score` is the correlation at offset 0 minus that median: in sync *and* following
the audio. The ceiling is the renderer's own frames for the same audio; the floor is
the same frames against audio shuffled in one-second blocks.

`motion` (part of the lipsync report) is the mouth's frame-to-frame change inside a latent
frame's group of 4 and across groups, against the renderer's own per-frame change on the
same audio: whether the lips move at 24 Hz or at the latent rate of 6.

`listen` runs the engine silent twice on the same noise, once hearing the user's voice: how much
each frame changes with it, correlated with the user's loudness, against the voice shuffled in
one-second blocks, and the renderer's own listening motion as the ceiling.

`idle` runs the engine on silence: how much the picture and the eyes move each second, the
blinks (the eyes' white covered by the lids, in boxes the renderer's geometry gives as it
gives the mouth's), and the longest window without motion, against the renderer's own
idle frames.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import character as ch
from engine.audio import SAMPLE_RATE, frame_sample, load_wav_16k
from engine.audio import read_audio as read_audio_file
from engine.build import build_engine
from engine.cache import KV_DTYPES
from engine.listen import listening_features
from engine.options import (
    CONFIG_PRESETS,
    DTYPES,
    GROUP_BLEND,
    EngineOptions,
    check_options,
    options_device,
    parse_options,
)
from engine.session import CACHES
from engine.weights import pick_device

if TYPE_CHECKING:
    from engine.realtime import RealtimeCharacter

MAX_OFFSET = 15  # frames either side (SyncNet searches +-15 at 25 fps)
_ENV_FLOOR_DB = -60.0


# Measurements ---------------------------------------------------------------------------
def mouth_box(look: str | ch.Look, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """Pixel box (y0, y1, x0, x1) that holds the mouth at any head sway of the renderer."""
    lk = ch.get_look(look)
    h, w = size
    cy = lk.head_y + lk.mouth_y
    half_w = lk.mouth_w * 1.3 + 0.03 + 0.05  # widest mouth + lips + sway
    top, bottom = cy - 0.10 - 0.02, cy + lk.mouth_w * 0.8 + 0.03 + 0.03

    def px_y(v: float) -> int:
        return int(round((v + 1.0) * h / 2.0))

    def px_x(u: float) -> int:
        return int(round((u + w / h) * h / 2.0))

    y0, y1 = max(px_y(top), 0), min(px_y(bottom), h)
    x0, x1 = max(px_x(-half_w), 0), min(px_x(half_w), w)
    if y1 - y0 < 2 or x1 - x0 < 2:
        raise ValueError(f"mouth box {(y0, y1, x0, x1)} is empty at image size {size}")
    return y0, y1, x0, x1


def eye_boxes(look: str | ch.Look, size: tuple[int, int]) -> tuple[tuple[int, int, int, int], ...]:
    """Pixel boxes (y0, y1, x0, x1), left eye then right, that hold each eye and its lid at any head sway and
    tilt of the renderer (engine.character.idle_motion: sway up to 0.035 across and 0.018 down, tilt 0.05)."""
    lk = ch.get_look(look)
    h, w = size
    cy = lk.head_y + lk.eye_y
    half_x, half_y = lk.eye_rx + 0.012 + 0.045, lk.eye_ry + 0.012 + 0.03

    def px_y(v: float) -> int:
        return int(round((v + 1.0) * h / 2.0))

    def px_x(u: float) -> int:
        return int(round((u + w / h) * h / 2.0))

    boxes = []
    for side in (-1.0, 1.0):
        cx = side * lk.eye_dx
        y0, y1 = max(px_y(cy - half_y), 0), min(px_y(cy + half_y), h)
        x0, x1 = max(px_x(cx - half_x), 0), min(px_x(cx + half_x), w)
        if y1 - y0 < 2 or x1 - x0 < 2:
            raise ValueError(f"eye box {(y0, y1, x0, x1)} is empty at image size {size}")
        boxes.append((y0, y1, x0, x1))
    return tuple(boxes)


def _uint8_frames(frames: torch.Tensor | np.ndarray, least: int = 1) -> torch.Tensor:
    x = torch.as_tensor(np.asarray(frames) if not isinstance(frames, torch.Tensor) else frames)
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8 or x.shape[0] < least:
        raise ValueError(f"frames must be (T >= {least}, H, W, 3) uint8, got {tuple(x.shape)} {x.dtype}")
    return x


def _eye_pixels(x: torch.Tensor, look: str | ch.Look) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> both eye boxes' pixels (T, N, 3) in [0, 1]."""
    return torch.cat([x[:, y0:y1, x0:x1].flatten(1, 2) for y0, y1, x0, x1 in eye_boxes(look, tuple(x.shape[1:3]))],
                     1).float() / 255.0


def eye_whiteness(frames: torch.Tensor | np.ndarray, look: str | ch.Look) -> torch.Tensor:
    """Frames (T, H, W, 3) uint8 -> (T,): how much of the eye boxes shows the eyes' white (a soft count: a pixel
    counts fully within 0.05 of engine.character.EYE_WHITE on every channel, not at all from 0.2 on). A blink
    covers the white with the lid; plain darkness would not do, as closing a light-skinned character's eye
    brightens the box (skin over iris and pupil)."""
    x = _uint8_frames(frames)
    px = _eye_pixels(x, look)
    off = (px - torch.tensor(ch.EYE_WHITE)).abs().amax(-1)  # (T, N)
    return ((0.2 - off) / 0.15).clamp(0.0, 1.0).mean(1)


BLINK_DIP = 0.5  # a blink: the eyes' white below this share of the clip's median


def detect_blinks(whiteness: torch.Tensor, dip: float = BLINK_DIP, merge: int = 2) -> list[int]:
    """The first frame of each blink: runs of frames whose eye whiteness is below `dip` times the clip's median
    (eyes are open most of the time), runs `merge` frames apart or closer counted as one."""
    if whiteness.ndim != 1:
        raise ValueError(f"whiteness must be a 1-D series, got {tuple(whiteness.shape)}")
    level = float(whiteness.median()) if whiteness.numel() else 0.0
    if level <= 1e-6:  # no white to lose: no eyes seen open
        return []
    closed = (whiteness < dip * level).tolist()
    starts, last_closed = [], None
    for i, c in enumerate(closed):
        if c:
            if last_closed is None or i - last_closed > merge + 1:
                starts.append(i)
            last_closed = i
    return starts


STILL_THRESHOLD = 0.003  # mean |difference| (0..1) from a still stretch's first frame that ends it (0.77 of 255)
STILL_TARGET_S = 2.0  # the target: no window this long without motion


def still_stretches(frames: torch.Tensor | np.ndarray, threshold: float = STILL_THRESHOLD) -> list[int]:
    """Lengths, in frame intervals, of the clip cut greedily into still stretches: a stretch runs from its first
    frame while every frame stays within `threshold` (mean absolute difference, 0..1) of that first frame; the
    first frame farther off starts the next. Slow motion adds up and ends a stretch; noise alone does not."""
    x = _uint8_frames(frames, least=1)
    lengths, first = [], 0
    anchor = x[0].float()
    for t in range(1, x.shape[0]):
        if float((x[t].float() - anchor).abs().mean()) / 255.0 >= threshold:
            lengths.append(t - 1 - first)
            first, anchor = t, x[t].float()
    lengths.append(x.shape[0] - 1 - first)
    return lengths


def idle_motion_stats(frames: torch.Tensor | np.ndarray, look: str | ch.Look, fps: int = 24,
                      still_threshold: float = STILL_THRESHOLD) -> dict:
    """How an idle clip moves. Per second: the mean absolute frame-to-frame change (0..1) of the whole picture and
    of the eye boxes, and `shift_per_second`, the mean absolute difference between the first frames of one second
    and the next (motion that adds up, where frame-to-frame change also counts noise). Blinks (detect_blinks)
    and blinks a minute. `longest_still_s`: the longest still stretch (still_stretches at `still_threshold`),
    and how many last STILL_TARGET_S or more."""
    x = _uint8_frames(frames, least=2)
    T = x.shape[0]
    change = torch.stack([(x[t + 1].float() - x[t].float()).abs().mean() / 255.0 for t in range(T - 1)])
    eyes = _eye_pixels(x, look)
    eye_change = (eyes[1:] - eyes[:-1]).abs().mean(dim=(1, 2))
    per_second = [float(change[i:i + fps].mean()) for i in range(0, T - 1, fps)]
    eye_per_second = [float(eye_change[i:i + fps].mean()) for i in range(0, T - 1, fps)]
    shift = [float((x[i + fps].float() - x[i].float()).abs().mean()) / 255.0 for i in range(0, T - fps, fps)]
    stretches = still_stretches(x, still_threshold)
    blinks = detect_blinks(eye_whiteness(x, look))
    minutes = T / fps / 60.0
    return {
        "motion_per_second": per_second, "eye_motion_per_second": eye_per_second, "shift_per_second": shift,
        "motion_mean": float(change.mean()), "eye_motion_mean": float(eye_change.mean()),
        "motion_min_second": min(per_second), "shift_min_second": min(shift) if shift else None,
        "blinks": len(blinks), "blink_frames": blinks, "blinks_per_minute": len(blinks) / minutes,
        "longest_still_s": max(stretches) / fps,
        "still_windows_over_target": sum(1 for k in stretches if k / fps >= STILL_TARGET_S),
    }


def mouth_opening(frames: torch.Tensor | np.ndarray, look: str | ch.Look) -> torch.Tensor:
    """Frames (T, H, W, 3) uint8 -> mouth opening (T,): summed darkness in the mouth box, as a fraction of it."""
    x = torch.as_tensor(np.asarray(frames) if not isinstance(frames, torch.Tensor) else frames)
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"frames must be (T, H, W, 3) uint8, got {tuple(x.shape)} {x.dtype}")
    y0, y1, x0, x1 = mouth_box(look, tuple(x.shape[1:3]))
    roi = x[:, y0:y1, x0:x1].float() / 255.0
    lum = roi @ torch.tensor([0.299, 0.587, 0.114])  # (T, h, w)
    skin = torch.quantile(lum.flatten(1), 0.75, dim=1).view(-1, 1, 1)  # the box is mostly skin
    dark = float(torch.tensor(ch.MOUTH_DARK) @ torch.tensor([0.299, 0.587, 0.114]))
    darkness = ((skin - lum) / (skin - dark).clamp(min=0.05)).clamp(0.0, 1.0)
    return darkness.mean(dim=(1, 2))


def mouth_motion(frames: torch.Tensor | np.ndarray, look: str | ch.Look, group: int = 4) -> dict:
    """How the mouth moves from frame to frame: the mean absolute change of the mouth box's pixels (0..1)
    between consecutive frames inside a latent frame's group of `group` (frame 0 starts a group) and from
    one group to the next. A codec that decodes a group as one picture moves only across groups."""
    x = torch.as_tensor(np.asarray(frames) if not isinstance(frames, torch.Tensor) else frames)
    if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8 or x.shape[0] < 2 * group:
        raise ValueError(f"frames must be (T >= {2 * group}, H, W, 3) uint8, got {tuple(x.shape)} {x.dtype}")
    y0, y1, x0, x1 = mouth_box(look, tuple(x.shape[1:3]))
    roi = x[:, y0:y1, x0:x1].float() / 255.0
    change = (roi[1:] - roi[:-1]).abs().mean(dim=(1, 2, 3))  # change[t]: frame t -> t + 1
    across = (torch.arange(change.shape[0]) % group) == group - 1
    within_s, across_s = float(change[~across].mean()), float(change[across].mean())
    return {"within_group": within_s, "across_groups": across_s,
            "within_to_across": within_s / across_s if across_s > 0 else None, "per_frame": float(change.mean())}


def audio_envelope(pcm: np.ndarray | torch.Tensor, n_frames: int, fps: int = 24) -> torch.Tensor:
    """Loudness (T,) of each video frame's own samples, RMS in dBFS floored at -60."""
    x = torch.as_tensor(np.asarray(pcm, dtype=np.float32) if not isinstance(pcm, torch.Tensor) else pcm).float()
    if x.ndim != 1:
        raise ValueError(f"audio must be mono (samples,), got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("audio contains NaN or infinite samples")
    out = torch.full((n_frames,), _ENV_FLOOR_DB)
    for i in range(n_frames):
        a, b = frame_sample(i, fps), frame_sample(i + 1, fps)
        seg = x[a:b]
        if seg.numel():
            out[i] = max(20.0 * math.log10(float(seg.pow(2).mean().sqrt()) + 1e-9), _ENV_FLOOR_DB)
    return out


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 1e-12 else 0.0


def offset_correlations(mouth: torch.Tensor, envelope: torch.Tensor, max_offset: int = MAX_OFFSET) -> torch.Tensor:
    """Correlation (2 max_offset + 1,) of mouth[t] with envelope[t - k] for k = -max_offset .. max_offset."""
    if mouth.shape != envelope.shape or mouth.ndim != 1:
        raise ValueError(f"mouth {tuple(mouth.shape)} and envelope {tuple(envelope.shape)} must be equal-length 1-D series")
    n = mouth.shape[0]
    if n < 2 * max_offset + 8:
        raise ValueError(f"{n} frames are too few for offsets of +-{max_offset} (need {2 * max_offset + 8})")
    out = []
    for k in range(-max_offset, max_offset + 1):
        if k >= 0:
            out.append(_corr(mouth[k:], envelope[: n - k]))
        else:
            out.append(_corr(mouth[: n + k], envelope[-k:]))
    return torch.tensor(out)


def sync_scores(mouth: torch.Tensor, envelope: torch.Tensor, max_offset: int = MAX_OFFSET) -> dict:
    c = offset_correlations(mouth, envelope, max_offset)
    median = float(c.median())
    best = int(c.argmax())
    at0 = float(c[max_offset])
    return {
        "score": at0 - median,  # in sync and following the audio
        "corr_at_0": at0,
        "confidence": float(c[best]) - median,  # LSE-C
        "distance": 1.0 - float(c[best]),  # LSE-D in correlation units: lower is better
        "best_offset": best - max_offset,  # frames the mouth lags the audio
    }


def shuffled_floor(mouth: torch.Tensor, envelope: torch.Tensor, fps: int = 24, repeats: int = 8, seed: int = 0,
                   max_offset: int = MAX_OFFSET) -> dict:
    """Scores against the envelope cut into 1 s blocks and shuffled: what chance gives."""
    g = torch.Generator().manual_seed(seed)
    blocks = list(torch.split(envelope, fps))
    runs = []
    for _ in range(repeats):
        order = torch.randperm(len(blocks), generator=g)
        runs.append(sync_scores(mouth, torch.cat([blocks[i] for i in order]), max_offset))
    return {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}


def picture_stats(frames: torch.Tensor) -> dict:
    """Mean brightness (0..255) and sharpness (variance of the luminance Laplacian) of frames (T, H, W, 3)."""
    lum = frames.float() @ torch.tensor([0.299, 0.587, 0.114])  # (T, H, W)
    lap = lum[:, 1:-1, 1:-1] * 4 - lum[:, :-2, 1:-1] - lum[:, 2:, 1:-1] - lum[:, 1:-1, :-2] - lum[:, 1:-1, 2:]
    return {"brightness": float(lum.mean()), "sharpness": float(lap.var(dim=(1, 2)).mean())}


# Running the engine -------------------------------------------------------------------------
ON_CPU = EngineOptions(name="quality", device="cpu")  # the reports' engine when none is given


def engine_frames(spec, pcm: np.ndarray, preset: str, options: EngineOptions = ON_CPU, user: np.ndarray | None = None):
    """Generate frames for `pcm` with the engine the options build; yields (first_frame, rgb (4, H, W, 3) uint8) per
    step. With `user`, the character hears the user's voice too (stream_frames).

    Returns (generator, trained) so callers can stream long sessions without keeping frames.
    """
    built = build_engine(options, spec, look=preset)
    return stream_frames(built.character, spec, pcm, built.close, user), built.trained


AUDIO_CHUNK = 2 * SAMPLE_RATE  # samples pushed at a time


def stream_frames(character: RealtimeCharacter, spec, pcm: np.ndarray,
                  close: Callable[[], None] | None = None, user: np.ndarray | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Generator of (first_frame, rgb (4, H, W, 3) uint8) per step for `pcm`, calling `close` at the end.

    The audio goes in a chunk at a time, a second or more ahead of the next frame: the timeline
    stays short, so a step's feature computation does not scan the rest of a long session.
    `user`, the user's voice on the same clock, is heard up to the end of each step's frames before it
    is made (`RealtimeCharacter.listen`).
    """
    steps = math.ceil(math.ceil(pcm.size * spec.fps / SAMPLE_RATE) / spec.frames_per_latent)
    try:
        made, pushed, heard = 0, 0, 0
        while made < steps:
            ahead = frame_sample(character.steps.next_frame + spec.fps, spec.fps)
            while pushed < min(ahead, pcm.size):
                character.push_audio(pcm[pushed:pushed + AUDIO_CHUNK], SAMPLE_RATE)
                pushed += AUDIO_CHUNK
            if user is not None:
                end = frame_sample(character.steps.next_frame + spec.frames_per_latent, spec.fps)
                chunk = user[heard:end]
                character.listen(np.concatenate([chunk, np.zeros(max(0, end - heard - chunk.size), np.float32)]))
                heard = end
            batch = character.make_step()
            if batch:  # empty only while a look-ahead step is in flight
                made += 1
                yield batch[0].index, np.stack([f.rgb for f in batch])
    finally:
        if close is not None:
            close()


def lipsync_report(spec, pcm: np.ndarray, preset: str = "ada", options: EngineOptions = ON_CPU, *,
                   max_offset: int = MAX_OFFSET) -> dict:
    """Generated frames, the renderer's ceiling and the shuffled-audio floor for one clip; the renderer and the
    floor's shuffles draw from options.session_seed."""
    seed = options.session_seed
    n = math.ceil(pcm.size * spec.fps / SAMPLE_RATE)
    env = audio_envelope(pcm, n, spec.fps)
    gen, trained = engine_frames(spec, pcm, preset, options)
    t0 = time.perf_counter()  # from the first step, as in long_session_report: loading is not stepping
    frames = np.concatenate([rgb for _, rgb in gen])[:n]
    gen_seconds = time.perf_counter() - t0
    generated = torch.from_numpy(frames)
    rendered, _ = ch.render_audio(pcm, preset, seed=seed, size=spec.image_size, n_frames=n)
    m_gen, m_ren = mouth_opening(generated, preset), mouth_opening(rendered, preset)
    gen_s, ceil_s = sync_scores(m_gen, env, max_offset), sync_scores(m_ren, env, max_offset)
    motion, rendered_motion = mouth_motion(generated, preset, spec.frames_per_latent), mouth_motion(rendered, preset)
    motion["within_to_renderer"] = (motion["within_group"] / rendered_motion["per_frame"]
                                    if rendered_motion["per_frame"] > 0 else None)
    return {
        "spec": spec.name, "preset": preset, "frames": n, "seconds": n / spec.fps, "trained_weights": trained,
        "generated": gen_s, "ceiling": ceil_s,
        "floor": shuffled_floor(m_gen, env, spec.fps, seed=seed, max_offset=max_offset),
        "ceiling_floor": shuffled_floor(m_ren, env, spec.fps, seed=seed, max_offset=max_offset),
        "ratio_to_ceiling": gen_s["score"] / ceil_s["score"] if ceil_s["score"] > 1e-6 else None,
        "motion": motion, "rendered_motion": rendered_motion,
        "generated_picture": picture_stats(generated), "rendered_picture": picture_stats(rendered),
        "steps_per_second": math.ceil(n / spec.frames_per_latent) / gen_seconds, "device": str(options_device(options)),
    }


LISTEN_SMOOTH_S = 0.5  # the user's loudness is averaged over this much before it is compared with the motion


def listening_signal(pcm: np.ndarray, n_frames: int, fps: int = 24) -> torch.Tensor:
    """The user's voice as one number per frame: its loudness (dBFS, audio_envelope) averaged over the last
    LISTEN_SMOOTH_S (a listener's motion follows speech over phrases, not over single frames)."""
    env = audio_envelope(pcm, n_frames, fps)
    k = max(1, round(LISTEN_SMOOTH_S * fps))
    padded = torch.cat([env[:1].expand(k - 1), env])
    return padded.unfold(0, k, 1).mean(1)


def listening_scores(change: torch.Tensor, signal: torch.Tensor, fps: int = 24, repeats: int = 8, seed: int = 0) -> dict:
    """How the picture's change from the unheard session follows the user's voice: Pearson correlation at offset
    0, against the same voice cut into 1 s blocks and shuffled `repeats` times (chance). The sign depends on the
    mix of motions (brows rise with the voice, a nod comes as it stops), so the test is of its size: |corr| above
    every shuffled |corr|."""
    g = torch.Generator().manual_seed(seed)
    blocks = list(torch.split(signal, fps))
    shuffled = [abs(_corr(change, torch.cat([blocks[i] for i in torch.randperm(len(blocks), generator=g)])))
                for _ in range(repeats)]
    corr = _corr(change, signal)
    return {"corr": corr, "shuffled_abs_mean": float(np.mean(shuffled)), "shuffled_abs_max": float(np.max(shuffled)),
            "above_shuffled": abs(corr) > max(shuffled), "mean_change": float(change.mean())}


def listen_report(spec, user: np.ndarray, preset: str = "ada", options: EngineOptions = ON_CPU, *,
                  sheet: str | Path | None = None, every: int = 12, columns: int = 8) -> dict:
    """The character silent while the user speaks `user`: the engine run twice on the same noise, hearing the
    user and not, and each frame's mean absolute difference between the two (0..1) against the user's voice
    (listening_signal); the renderer's own listening motion (engine.character.listen) is the ceiling. With
    `sheet`, a PNG: the unheard row, the heard row and the renderer's, every `every`-th frame."""
    seed = options.session_seed
    n = math.ceil(user.size * spec.fps / SAMPLE_RATE)
    if n < 4 * spec.fps:
        raise ValueError(f"the user's audio is {n / spec.fps:.1f} s: the report needs at least 4 s")
    silence = np.zeros(frame_sample(n, spec.fps), np.float32)
    user = np.concatenate([user.astype(np.float32), silence])[:silence.size]
    runs = {}
    for name, heard in (("unheard", None), ("heard", user)):
        gen, trained = engine_frames(spec, silence, preset, options, user=heard)
        runs[name] = torch.from_numpy(np.concatenate([rgb for _, rgb in gen])[:n])
    states = ch.frame_states(ch.mouth_from_audio(silence, n, spec.fps), seed, 0, spec.fps)
    listening = listening_features(user, spec.fps)[:n]
    rendered = {"unheard": ch.render_states(preset, states, spec.image_size),
                "heard": ch.render_states(preset, ch.listen(states, listening), spec.image_size)}
    signal = listening_signal(user, n, spec.fps)

    def change(frames: dict) -> torch.Tensor:
        return (frames["heard"].float() - frames["unheard"].float()).abs().mean(dim=(1, 2, 3)) / 255.0

    report = {"spec": spec.name, "preset": preset, "frames": n, "seconds": n / spec.fps, "trained_weights": trained,
              "generated": listening_scores(change(runs), signal, spec.fps, seed=seed),
              "rendered": listening_scores(change(rendered), signal, spec.fps, seed=seed),
              "device": str(options_device(options))}
    if sheet is not None:
        rows = [runs["unheard"].numpy(), runs["heard"].numpy(), rendered["heard"].numpy()]
        write_png(sheet, contact_sheet(rows, every, columns))
        report["sheet"] = {"out": str(sheet), "rows": "generated unheard, generated hearing the user, renderer hearing",
                           "frames_every": every}
    return report


def clip_reports(spec, pcm: np.ndarray, clips: int, preset: str, min_seconds: float, options: EngineOptions = ON_CPU,
                 *, max_offset: int = MAX_OFFSET) -> dict:
    """The audio cut into `clips` equal clips, each run and scored on its own (a fresh session): each clip's
    score, share of the ceiling, best offset and motion, and on how many the best offset is 0."""
    size = pcm.size // clips
    if size < min_seconds * SAMPLE_RATE:
        raise ValueError(f"{clips} clips of {size / SAMPLE_RATE:.2f} s: each needs at least {min_seconds:.1f} s")
    out = []
    for i in range(clips):
        r = lipsync_report(spec, pcm[i * size:(i + 1) * size], preset, options, max_offset=max_offset)
        out.append({"seconds": r["seconds"], "score": r["generated"]["score"], "ratio_to_ceiling": r["ratio_to_ceiling"],
                    "best_offset": r["generated"]["best_offset"], "ceiling_best_offset": r["ceiling"]["best_offset"],
                    "within_to_across": r["motion"]["within_to_across"],
                    "within_to_renderer": r["motion"]["within_to_renderer"]})
    return {"clips": out, "best_offset_zero": sum(c["best_offset"] == 0 for c in out), "of": clips}


def idle_report(spec, seconds: float, preset: str = "ada", options: EngineOptions = ON_CPU, *,
                still_threshold: float = STILL_THRESHOLD) -> dict:
    """The engine on silence for `seconds` (built as lipsync builds it), against the renderer's own idle frames
    (head sway, gaze, blinks, mouth closed: engine.character) for as long, the ceiling: idle_motion_stats of both.
    The target: no window of STILL_TARGET_S without motion, and blinks as often as the renderer's."""
    n = math.ceil(seconds * spec.fps)
    if n < 2 * spec.fps:
        raise ValueError(f"--seconds {seconds:g} is too short: the report needs at least 2 s")
    silence = np.zeros(frame_sample(n, spec.fps), np.float32)
    gen, trained = engine_frames(spec, silence, preset, options)
    t0 = time.perf_counter()
    generated = torch.from_numpy(np.concatenate([rgb for _, rgb in gen])[:n])
    gen_seconds = time.perf_counter() - t0
    rendered, states = ch.render_audio(silence, preset, seed=options.session_seed, size=spec.image_size, n_frames=n)
    ceiling = idle_motion_stats(rendered, preset, spec.fps, still_threshold)
    ceiling["blinks_in_state"] = len(detect_blinks(1.0 - states[:, ch.S["blink"]], dip=0.5))
    return {
        "spec": spec.name, "preset": preset, "seconds": n / spec.fps, "frames": n, "trained_weights": trained,
        "still_threshold": still_threshold, "still_target_s": STILL_TARGET_S,
        "generated": idle_motion_stats(generated, preset, spec.fps, still_threshold), "rendered": ceiling,
        "steps_per_second": math.ceil(n / spec.frames_per_latent) / gen_seconds, "device": str(options_device(options)),
    }


def long_session_report(spec, pcm: np.ndarray, minutes: float, preset: str = "ada", options: EngineOptions = ON_CPU, *,
                        max_offset: int = MAX_OFFSET, progress: Callable[[dict], None] | None = None) -> dict:
    """The clip looped (with 1 s of silence between repeats) for `minutes`; metric and picture per minute.

    Per minute: the lip-sync scores, mean brightness, sharpness and `ref_diff`, the mean absolute
    difference (0..255) from the reference picture (identity drift shows as a rising value).
    The renderer's score over the first minute is the ceiling.
    """
    if minutes * 60 * spec.fps < 2 * max_offset + 8:
        raise ValueError(f"--minutes {minutes} is too short for offsets of +-{max_offset} frames")
    gap = np.zeros(SAMPLE_RATE, np.float32)
    unit = np.concatenate([pcm.astype(np.float32), gap])
    total = int(minutes * 60 * SAMPLE_RATE)
    looped = np.tile(unit, math.ceil(total / unit.size))[:total]
    n = math.ceil(total * spec.fps / SAMPLE_RATE)
    env = audio_envelope(looped, n, spec.fps)
    per_minute = 60 * spec.fps
    mouth = torch.zeros(n)
    stats: list[list[dict]] = []
    reference = ch.reference_image(preset, spec.image_size).float()
    gen, trained = engine_frames(spec, looped, preset, options)
    t0 = time.perf_counter()
    for first, rgb in gen:
        rgb_t = torch.from_numpy(rgb)[: max(0, n - first)]
        if rgb_t.shape[0] == 0:
            continue
        mouth[first:first + rgb_t.shape[0]] = mouth_opening(rgb_t, preset)
        minute = first // per_minute
        while len(stats) <= minute:
            stats.append([])
        stats[minute].append({**picture_stats(rgb_t), "ref_diff": float((rgb_t.float() - reference).abs().mean())})
        if progress is not None and first % per_minute == 0:
            progress({"minute": minute, "elapsed": time.perf_counter() - t0})
    rows = []
    for m in range(len(stats)):
        sl = slice(m * per_minute, min((m + 1) * per_minute, n))
        if sl.stop - sl.start < 2 * max_offset + 8:
            continue
        rows.append({"minute": m, **sync_scores(mouth[sl], env[sl], max_offset),
                     **{k: float(np.mean([s[k] for s in stats[m]])) for k in ("brightness", "sharpness", "ref_diff")}})
    seconds = time.perf_counter() - t0
    first_m, last_m = rows[0], rows[-1]
    n_ceiling = min(n, per_minute)
    rendered, _ = ch.render_audio(looped, preset, seed=options.session_seed, size=spec.image_size, n_frames=n_ceiling)
    return {
        "spec": spec.name, "preset": preset, "minutes": minutes, "trained_weights": trained, "per_minute": rows,
        "first_vs_last": {k: {"first": first_m[k], "last": last_m[k], "change": last_m[k] - first_m[k]}
                          for k in ("score", "confidence", "brightness", "sharpness", "ref_diff")},
        "ceiling_first_minute": sync_scores(mouth_opening(rendered, preset), env[:n_ceiling], max_offset),
        "steps_per_second": math.ceil(n / spec.frames_per_latent) / seconds,
        "device": str(options_device(options)), "config": options.describe(),
        "position_resets": _resets(spec, math.ceil(n / spec.frames_per_latent), options),
    }


def _resets(spec, steps: int, options: EngineOptions) -> int:
    """Position resets the session went through (the ring cache rotates its keys back every `reset_every` steps)."""
    every = spec.reset_interval(options.reset_every)
    return steps // every if options.cache == "ring" and every > 0 else 0


DRIFT_LIMITS = {"score_drop": 0.08, "level_change": 8.0, "sharpness_change": 0.25}


def drift_verdict(report: dict, limits: dict | None = None) -> dict:
    """First minute against last: 'stable' unless lip sync fell, or brightness / distance from the
    reference moved (0..255 levels), or sharpness changed (relative), by more than the limits."""
    lim = {**DRIFT_LIMITS, **(limits or {})}
    fl = report["first_vs_last"]
    reasons = []
    if -fl["score"]["change"] > lim["score_drop"]:
        reasons.append(f"lip-sync score fell by {-fl['score']['change']:.3f} (limit {lim['score_drop']})")
    for key in ("brightness", "ref_diff"):
        if abs(fl[key]["change"]) > lim["level_change"]:
            reasons.append(f"{key} moved by {fl[key]['change']:+.2f} levels (limit {lim['level_change']})")
    first_sharp = max(abs(fl["sharpness"]["first"]), 1e-6)
    if abs(fl["sharpness"]["change"]) / first_sharp > lim["sharpness_change"]:
        reasons.append(f"sharpness changed by {fl['sharpness']['change'] / first_sharp:+.0%} (limit {lim['sharpness_change']:.0%})")
    rows = report["per_minute"]
    slope = float(np.polyfit([r["minute"] for r in rows], [r["score"] for r in rows], 1)[0]) if len(rows) >= 2 else 0.0
    if len(rows) < 2:  # one minute is compared only with itself
        return {"verdict": "too short to tell", "reasons": ["needs at least two minutes: the first against the last"],
                "limits": lim, "score_slope_per_minute": slope, "minutes_compared": [rows[0]["minute"]] if rows else []}
    return {"verdict": "drifting" if reasons else "stable", "reasons": reasons, "limits": lim,
            "score_slope_per_minute": slope, "minutes_compared": [rows[0]["minute"], rows[-1]["minute"]]}


# Engine configurations ---------------------------------------------------------------------
def config_frames(config: EngineOptions, spec, pcm: np.ndarray, look: str, *, noise_seed: int,
                  weights: str | None = None, weights_seed: int = 0):
    """Frames for `pcm` under `config`, streamed: (generator of (first_frame, rgb (4, H, W, 3) uint8), trained)."""
    return engine_frames(spec, pcm, look, varied_noise(config, noise_seed, weights, weights_seed))


def varied_noise(config: EngineOptions, noise_seed: int, weights: str | None = None, weights_seed: int = 0) -> EngineOptions:
    """config with its weights fixed (the checkpoint, or random ones from weights_seed) and its noise from noise_seed."""
    return replace(config, weights=weights, seed=weights_seed, noise_seed=noise_seed)


# Compare: a numerics change against the spread of reruns ------------------------------------
RERUN_SEED_OFFSET = 1_000_003  # A' draws its sampling noise from seed + this
RERUN_DEFINITION = ("A' is configuration A run again on the same clips (same audio, character and weights) with "
                    "a fresh sampling-noise seed (clip seed + 1000003): the variation a user sees between two runs. "
                    "A rerun with the same seed is bit-identical on the CPU, so it would measure nothing.")
SEED_THRESHOLDS = {"max_abs_mean": 0.03, "max_abs_ci95": 0.08}  # the seed's bar: mean within 0.03, 95% CI within +-0.08
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% point: a table to 30 degrees of freedom, then Cornish-Fisher's first term."""
    if df < 1:
        raise ValueError("an interval needs at least 2 clips")
    return _T975[df - 1] if df <= len(_T975) else 1.959964 + (1.959964**3 + 1.959964) / (4 * df)


def mean_ci95(values: list[float]) -> dict:
    """Mean and the 95% t-interval of the mean of paired differences."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        raise ValueError("an interval needs at least 2 clips")
    half = t_quantile_975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    mean = float(x.mean())
    return {"mean": mean, "ci95": [mean - half, mean + half], "sd": float(x.std(ddof=1)), "n": int(x.size)}


def verdict(diff: dict, rerun: dict) -> dict:
    """Within the rerun band: the B-A interval lies inside +-(the farthest end of the A'-A interval)."""
    band = max(abs(rerun["ci95"][0]), abs(rerun["ci95"][1]))
    lo, hi = diff["ci95"]
    within = -band <= lo and hi <= band
    seed_ok = abs(diff["mean"]) <= SEED_THRESHOLDS["max_abs_mean"] and max(abs(lo), abs(hi)) <= SEED_THRESHOLDS["max_abs_ci95"]
    return {"rerun_band": [-band, band], "within_rerun_band": within,
            "verdict": "within the rerun band" if within else "outside the rerun band", "seed_thresholds_met": seed_ok}


def speech_clip(seed: int, seconds: float, source: str) -> np.ndarray:
    """A speech clip reproducible from its seed: utterances and pauses (training.train's corpus maker)."""
    from training.train import make_corpus

    pcm16, _ = make_corpus(seconds, seed, (source,))
    return pcm16.astype(np.float32) / 32768.0


def default_audio_source() -> str:
    import shutil

    return "espeak" if shutil.which("espeak-ng") else "synth"


def _clip_run(config: EngineOptions, spec, pcm: np.ndarray, look: str, noise_seed: int, weights, max_offset: int):
    n = math.ceil(pcm.size * spec.fps / SAMPLE_RATE)
    gen, trained = config_frames(config, spec, pcm, look, noise_seed=noise_seed, weights=weights)
    frames = torch.from_numpy(np.concatenate([rgb for _, rgb in gen])[:n])
    scores = sync_scores(mouth_opening(frames, look), audio_envelope(pcm, n, spec.fps), max_offset)
    return frames, scores, trained


def compare(spec, a: EngineOptions, bs: list[EngineOptions], *, clips: int, clip_seconds: float = 4.0, seed: int = 0,
            source: str | None = None, weights: str | None = None, max_offset: int = MAX_OFFSET, progress=None) -> dict:
    """N clips (audio and noise seed per clip) under A, A' (A with fresh noise) and each B; lip-sync scores,
    the mean B-A difference with its 95% interval next to A'-A, and a verdict per B."""
    if clips < 2:
        raise ValueError(f"--clips must be at least 2 for an interval, got {clips}")
    if clip_seconds * spec.fps < 2 * max_offset + 8:
        raise ValueError(f"--clip-seconds {clip_seconds:g} is too short: the metric needs {(2 * max_offset + 8) / spec.fps:.2f} s")
    for config in (a, *bs):
        check_options(config, spec)
    source = source or default_audio_source()
    looks = list(ch.PRESETS)
    runs = {"A": a, "A'": a, **{f"B{i}": b for i, b in enumerate(bs)}}
    rows, trained, t0 = [], False, time.perf_counter()
    wall = {k: 0.0 for k in runs}
    for i in range(clips):
        clip_seed = seed + i
        pcm = speech_clip(clip_seed, clip_seconds, source)
        look = looks[i % len(looks)]
        row, frames_a = {"clip": i, "audio_seed": clip_seed, "look": look}, None
        for key, config in runs.items():
            noise = clip_seed + (RERUN_SEED_OFFSET if key == "A'" else 0)
            t1 = time.perf_counter()
            frames, scores, trained = _clip_run(config, spec, pcm, look, noise, weights, max_offset)
            wall[key] += time.perf_counter() - t1
            row[key] = {"score": scores["score"], "confidence": scores["confidence"], "best_offset": scores["best_offset"]}
            if key == "A":
                frames_a = frames
            else:  # mean |frame difference| to A (0..255): same noise seed for B, fresh for A'
                row[key]["pixel_diff"] = float((frames.float() - frames_a.float()).abs().mean())
        rows.append(row)
        if progress is not None:
            progress({"clip": i + 1, "of": clips, "elapsed_s": round(time.perf_counter() - t0, 1)})
    rerun = mean_ci95([r["A'"]["score"] - r["A"]["score"] for r in rows])
    rerun_pixels = float(np.mean([r["A'"]["pixel_diff"] for r in rows]))
    comparisons = []
    for i, b in enumerate(bs):
        key = f"B{i}"
        diff = mean_ci95([r[key]["score"] - r["A"]["score"] for r in rows])
        comparisons.append({"b": b.describe(), "diff_b_minus_a": diff, "rerun_a_prime_minus_a": rerun,
                            "confidence_diff": mean_ci95([r[key]["confidence"] - r["A"]["confidence"] for r in rows]),
                            "pixel_diff_b_vs_a": float(np.mean([r[key]["pixel_diff"] for r in rows])),
                            "pixel_diff_rerun": rerun_pixels, **verdict(diff, rerun),
                            "seconds": wall[key]})
    return {
        "spec": spec.name, "trained_weights": trained, "clips": clips, "clip_seconds": clip_seconds,
        "audio_source": source, "seed": seed, "metric": "lip-sync score (correlation at offset 0 minus the median over offsets)",
        "a": a.describe(), "rerun_definition": RERUN_DEFINITION, "seed_thresholds": SEED_THRESHOLDS,
        "rerun_a_prime_minus_a": rerun, "comparisons": comparisons, "per_clip": rows,
        "seconds": {"A": wall["A"], "A'": wall["A'"]}, "wall_seconds": time.perf_counter() - t0,
    }


def read_audio(path: str | Path, max_seconds: float) -> np.ndarray:
    """Audio file -> 16 kHz mono float32: any format through PyAV; where PyAV is absent, WAV files
    through the engine's own reader, so the lab measures on hosts that have only torch."""
    try:
        return read_audio_file(path, max_seconds=max_seconds)
    except ModuleNotFoundError as e:
        if e.name != "av":
            raise
    if not Path(path).is_file():
        raise ValueError(f"audio file not found: {path}")
    try:
        return load_wav_16k(path, max_seconds=max_seconds)
    except ValueError as e:
        raise ValueError(f"{e} (read as WAV: PyAV, which reads other formats, is not installed)") from e


# Contact sheets ------------------------------------------------------------------------------
def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """(H, W, 3) uint8 -> PNG file, with nothing but zlib."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"PNG picture must be (H, W, 3) uint8, got {rgb.shape}")
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def contact_sheet(rows: list[np.ndarray], every: int, columns: int) -> np.ndarray:
    """Rows of frames (T, H, W, 3) -> one picture: every `every`-th frame, `columns` per row."""
    out = []
    for frames in rows:
        picks = frames[::every][:columns]
        if picks.shape[0] < columns:
            raise ValueError(f"{frames.shape[0]} frames are too few for {columns} columns every {every}")
        out.append(np.concatenate(list(picks), axis=1))
    return np.concatenate(out, axis=0)


def sheet(spec, pcm: np.ndarray, presets: list[str], out: str | Path, options: EngineOptions = ON_CPU, *,
          every: int = 6, columns: int = 8, with_renderer: bool = True) -> dict:
    """Generated frames of each preset (and the renderer's own, for comparison) as a PNG."""
    n = every * columns
    need = math.ceil(n / spec.fps * SAMPLE_RATE)
    pcm = np.concatenate([pcm, np.zeros(max(0, need - pcm.size), np.float32)])[:need]
    rows, trained = [], False
    for preset in presets:
        gen, trained = engine_frames(spec, pcm, preset, options)
        rows.append(np.concatenate([rgb for _, rgb in gen])[:n])
        if with_renderer:
            rows.append(ch.render_audio(pcm, preset, seed=options.session_seed, size=spec.image_size, n_frames=n)[0].numpy())
    write_png(out, contact_sheet(rows, every, columns))
    return {"out": str(out), "presets": presets, "rows": len(rows), "frames_every": every, "trained_weights": trained,
            "layout": "per preset: generated row, then the renderer's row" if with_renderer else "generated rows"}


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The reports' engine from the arguments engine_arguments adds (a sheet's: weights, device and seed only)."""
    plain = EngineOptions()
    return EngineOptions(name=args.cmd, weights=args.weights, device=str(pick_device(args.device)), seed=args.seed,
                         cache=getattr(args, "cache", plain.cache), kv_dtype=getattr(args, "kv_dtype", plain.kv_dtype),
                         dtype=getattr(args, "dtype", plain.dtype),
                         group_blend=getattr(args, "group_blend", plain.group_blend))


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine a report runs: the character, its weights, the device, the cache and the noise seed."""
    parser.add_argument("--preset", default="ada", help=f"one of {', '.join(ch.PRESETS)}")
    parser.add_argument("--weights", help="DiT checkpoint (default: the one shipped for the spec)")
    parser.add_argument("--device", default="auto", help="auto (a GPU when one is visible), cpu, cuda or cuda:N")
    parser.add_argument("--cache", default="ring", choices=CACHES)
    parser.add_argument("--kv-dtype", default="fp8", choices=sorted(KV_DTYPES))
    parser.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                        help="the model's and codec's numbers (auto: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--group-blend", type=float, default=GROUP_BLEND,
                        help="each step's first frame this much the frame before it (0: as the codec draws it)")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    from engine.config import SPECS, get_spec

    p = argparse.ArgumentParser(prog="python -m lab.quality", description=__doc__.strip().splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("lipsync", help="score generated frames against the audio, with ceiling and floor")
    ls.add_argument("--spec", default="demo", choices=sorted(SPECS))
    ls.add_argument("--audio", required=True, help="any audio file FFmpeg reads")
    engine_arguments(ls)
    ls.add_argument("--max-offset", type=int, default=MAX_OFFSET, help="frames searched either side")
    ls.add_argument("--minutes", type=float, default=None, help="long session: loop the audio this long, report per minute")
    ls.add_argument("--max-seconds", type=float, default=120.0, help="refuse longer audio")
    ls.add_argument("--clips", type=int, default=1, help="also score the audio cut into this many clips, each on its own")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    sh = sub.add_parser("sheet", help="contact sheet PNG of generated frames (and the renderer's) per preset")
    sh.add_argument("--spec", default="demo", choices=sorted(SPECS))
    sh.add_argument("--audio", required=True)
    sh.add_argument("--presets", default="ada,kofi", help="comma-separated")
    sh.add_argument("--out", required=True, help="PNG to write")
    sh.add_argument("--every", type=int, default=6, help="take every n-th frame")
    sh.add_argument("--columns", type=int, default=8)
    sh.add_argument("--weights")
    sh.add_argument("--device", default="auto", help="auto (a GPU when one is visible), cpu, cuda or cuda:N")
    sh.add_argument("--seed", type=int, default=0)
    presets = ", ".join(CONFIG_PRESETS)
    cp = sub.add_parser("compare", help="a numerics change (B) against the spread of reruns of A, over N clips")
    cp.add_argument("--a", required=True, help=f"baseline config: PRESET[,key=value...] or a JSON file; presets: {presets}")
    cp.add_argument("--b", required=True, action="append", help="config to judge (repeat for several; A and A' are shared)")
    cp.add_argument("--clips", type=int, default=8, help="clips (each its own speech, character and seed)")
    cp.add_argument("--clip-seconds", type=float, default=4.0)
    cp.add_argument("--spec", default="demo", choices=sorted(SPECS))
    cp.add_argument("--weights", help="DiT checkpoint (default: the one shipped for the spec)")
    cp.add_argument("--seed", type=int, default=0, help="clip i uses audio and noise seed seed + i")
    cp.add_argument("--audio-source", default=None, choices=("espeak", "piper", "synth"),
                    help="speech for the clips (default: espeak-ng when installed, else synthetic babble)")
    cp.add_argument("--max-offset", type=int, default=MAX_OFFSET, help="frames searched either side")
    cp.add_argument("--json", action="store_true", help="print one JSON object")
    dr = sub.add_parser("drift", help="long session: metric and picture per minute, first minute against last, verdict")
    dr.add_argument("--spec", default="demo", choices=sorted(SPECS))
    dr.add_argument("--minutes", type=float, default=10.0)
    dr.add_argument("--audio", default=None, help="clip to loop (default: speech made from --seed)")
    dr.add_argument("--config", default="fp8-cache", help=f"PRESET[,key=value...] or a JSON file; presets: {presets}")
    dr.add_argument("--preset", default="ada", help=f"character, one of {', '.join(ch.PRESETS)}")
    dr.add_argument("--weights")
    dr.add_argument("--seed", type=int, default=0)
    dr.add_argument("--max-offset", type=int, default=MAX_OFFSET)
    dr.add_argument("--max-score-drop", type=float, default=DRIFT_LIMITS["score_drop"])
    dr.add_argument("--max-level-change", type=float, default=DRIFT_LIMITS["level_change"])
    dr.add_argument("--json", action="store_true", help="print one JSON object")
    idl = sub.add_parser("idle", help="the engine on silence: picture and eye motion a second, blinks, the longest still "
                                      "window, against the renderer's idle frames")
    idl.add_argument("--spec", default="demo", choices=sorted(SPECS))
    idl.add_argument("--seconds", type=float, default=60.0)
    engine_arguments(idl)
    idl.add_argument("--still-threshold", type=float, default=STILL_THRESHOLD,
                     help="mean |difference| (0..1) from a still stretch's first frame that ends the stretch")
    idl.add_argument("--json", action="store_true", help="print one JSON object")
    lst = sub.add_parser("listen", help="the character silent while the user speaks: its change from the unheard "
                                        "session against the user's voice, and against the voice shuffled")
    lst.add_argument("--spec", default="demo", choices=sorted(SPECS))
    lst.add_argument("--audio", required=True, help="the user's voice: any audio file FFmpeg reads")
    lst.add_argument("--max-seconds", type=float, default=120.0, help="refuse longer audio")
    engine_arguments(lst)
    lst.add_argument("--sheet", default=None, help="also write a contact sheet PNG here")
    lst.add_argument("--every", type=int, default=12, help="the sheet takes every n-th frame")
    lst.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.cmd in ("listen", "idle"):
        try:
            ch.get_look(args.preset)
            engine = engine_options(args)
            if args.cmd == "listen":
                user = read_audio(args.audio, max_seconds=args.max_seconds)
                report = listen_report(get_spec(args.spec), user, args.preset, engine, sheet=args.sheet, every=args.every)
            else:
                if not args.seconds > 0 or not args.still_threshold > 0:
                    raise ValueError("--seconds and --still-threshold must be positive")
                report = idle_report(get_spec(args.spec), args.seconds, args.preset, engine,
                                     still_threshold=args.still_threshold)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(report) if args.json else json.dumps(report, indent=2))
        return 0
    if getattr(args, "max_offset", 1) < 1:  # offset 0 leaves one correlation: score and confidence are always 0
        print(f"error: --max-offset must be at least 1 frame, got {args.max_offset}", file=sys.stderr)
        return 2
    if args.cmd in ("compare", "drift"):
        try:
            report = _compare_cli(args) if args.cmd == "compare" else _drift_cli(args)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(report) if args.json else json.dumps(report, indent=2))
        return 0
    if args.cmd == "sheet":
        try:
            spec = get_spec(args.spec)
            presets = [x.strip() for x in args.presets.split(",") if x.strip()]
            for name in presets:
                ch.get_look(name)
            if Path(args.out).is_dir():
                raise ValueError(f"--out {args.out} is a folder: give the PNG file to write, e.g. sheet.png")
            pcm = read_audio(args.audio, max_seconds=600)
            info = sheet(spec, pcm, presets, args.out, engine_options(args), every=args.every, columns=args.columns)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(info))
        return 0
    try:
        spec = get_spec(args.spec)
        ch.get_look(args.preset)
        engine = engine_options(args)
        pcm = read_audio(args.audio, max_seconds=args.max_seconds)
        min_seconds = (2 * args.max_offset + 8) / spec.fps
        if pcm.size < min_seconds * SAMPLE_RATE:
            raise ValueError(f"{args.audio} is {pcm.size / SAMPLE_RATE:.2f} s; the metric needs at least {min_seconds:.1f} s")
        if args.minutes:
            progress = (lambda d: print(json.dumps(d), file=sys.stderr, flush=True))
            report = long_session_report(spec, pcm, args.minutes, args.preset, engine, max_offset=args.max_offset,
                                         progress=progress)
            report["drift"] = drift_verdict(report)
        else:
            report = lipsync_report(spec, pcm, args.preset, engine, max_offset=args.max_offset)
            if args.clips > 1:
                report["clips"] = clip_reports(spec, pcm, args.clips, args.preset, min_seconds, engine,
                                               max_offset=args.max_offset)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["audio"] = args.audio
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0


def _progress(d: dict) -> None:
    print(json.dumps(d), file=sys.stderr, flush=True)


def _compare_cli(args) -> dict:
    from engine.config import get_spec

    spec = get_spec(args.spec)
    a, bs = parse_options(args.a), [parse_options(b) for b in args.b]
    return compare(spec, a, bs, clips=args.clips, clip_seconds=args.clip_seconds, seed=args.seed,
                   source=args.audio_source, weights=args.weights, max_offset=args.max_offset, progress=_progress)


def _drift_cli(args) -> dict:
    from engine.config import get_spec

    spec = get_spec(args.spec)
    config = parse_options(args.config)
    ch.get_look(args.preset)
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes:g}")
    if args.audio is not None:
        pcm = read_audio(args.audio, max_seconds=600)
        if not pcm.size or not np.abs(pcm).max() > 0:
            raise ValueError(f"{args.audio} holds no sound: nothing for the mouth to follow")
    else:
        pcm = speech_clip(args.seed, 8.0, default_audio_source())
    report = long_session_report(spec, pcm, args.minutes, args.preset, varied_noise(config, args.seed, args.weights),
                                 max_offset=args.max_offset, progress=_progress)
    report["drift"] = drift_verdict(report, {"score_drop": args.max_score_drop, "level_change": args.max_level_change})
    report["audio"] = args.audio or f"speech made from seed {args.seed}"
    return report


if __name__ == "__main__":
    sys.exit(main())
