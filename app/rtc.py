"""WebRTC to the browser with aiortc: the character's video and voice out, the microphone in,
and a data channel for turn events and the browser's delivery reports.

Localhost only: no STUN or TURN server; host candidates are enough. Both outgoing tracks
belong to the peer connection's one media stream, so the browser plays them in sync,
and both are fed from the same released frame, so their timestamps agree.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import logging
import time
from collections import deque

import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from engine.audio import SAMPLE_RATE, frame_sample
from engine.realtime import AVFrame

log = logging.getLogger(__name__)

VIDEO_CLOCK = 90000
QUEUE_FRAMES = 48  # two seconds; a peer further behind than that loses its oldest frames
PACKET_SAMPLES = SAMPLE_RATE // 50  # 20 ms: one Opus packet per audio frame sent


class FrameQueue:
    """Frames handed from the pump thread to one track's asyncio side."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque(maxlen=QUEUE_FRAMES)
        self.ready = asyncio.Event()

    def put_threadsafe(self, item) -> None:
        self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item) -> None:
        self.items.append(item)
        self.ready.set()

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class PlayoutVideoTrack(MediaStreamTrack):
    kind = "video"

    def __init__(self, fps: int, queue: FrameQueue):
        super().__init__()
        self.fps, self.queue, self.first_index = fps, queue, None

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        frame: AVFrame = await self.queue.get()
        if self.first_index is None:
            self.first_index = frame.index
        out = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame.rgb), format="rgb24")
        out.pts = (frame.index - self.first_index) * VIDEO_CLOCK // self.fps
        out.time_base = fractions.Fraction(1, VIDEO_CLOCK)
        return out


class PlayoutAudioTrack(MediaStreamTrack):
    """The frames' audio in 20 ms frames. aiortc's sender stamps every Opus packet of one `recv()` with the same
    RTP timestamp (it expects 20 ms a call), so a video frame's 1/24 s in one call became two or three packets
    under one timestamp, and the browser discarded all but the first as duplicates."""

    kind = "audio"

    def __init__(self, fps: int, queue: FrameQueue):
        super().__init__()
        self.fps, self.queue, self.first_index = fps, queue, None
        self.pending = np.zeros(0, np.float32)  # audio received, not yet sent
        self.pending_at = 0  # its first sample's timestamp, in samples since the first frame

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        while self.pending.size < PACKET_SAMPLES:
            frame: AVFrame = await self.queue.get()
            if self.first_index is None:
                self.first_index = frame.index
            at = frame_sample(frame.index, self.fps) - frame_sample(self.first_index, self.fps)
            if at != self.pending_at + self.pending.size:  # frames dropped for a peer behind: go on from this one
                self.pending, self.pending_at = np.zeros(0, np.float32), at
            self.pending = np.concatenate([self.pending, frame.pcm.astype(np.float32)])
        chunk, self.pending = self.pending[:PACKET_SAMPLES], self.pending[PACKET_SAMPLES:]
        pcm = (np.clip(chunk, -1.0, 1.0) * 32767).astype(np.int16).reshape(1, -1)
        out = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        out.sample_rate = SAMPLE_RATE
        out.pts = self.pending_at
        out.time_base = fractions.Fraction(1, SAMPLE_RATE)
        self.pending_at += PACKET_SAMPLES
        return out


class ClockSync:
    """Browser clock (ms since the epoch) to this process's monotonic seconds, from pings
    over the data channel; the round trip with the least delay wins."""

    def __init__(self) -> None:
        self.offset: float | None = None  # browser seconds - monotonic seconds
        self.best_rtt = float("inf")

    def sample(self, sent: float, received: float, browser_ms: float) -> None:
        rtt = received - sent
        if rtt <= self.best_rtt:
            self.best_rtt = rtt
            self.offset = browser_ms / 1000.0 - (sent + received) / 2

    def to_monotonic(self, browser_ms: float) -> float | None:
        return None if self.offset is None else browser_ms / 1000.0 - self.offset

    def to_browser_ms(self, t: float) -> float | None:
        return None if self.offset is None else 1000.0 * (t + self.offset)


class Peer:
    """One browser connection to the live session."""

    def __init__(self, controller, live, loop: asyncio.AbstractEventLoop):
        self.controller, self.live, self.loop = controller, live, loop
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        fps = live.character.spec.fps
        self.video_queue, self.audio_queue = FrameQueue(loop), FrameQueue(loop)
        self.video = PlayoutVideoTrack(fps, self.video_queue)
        self.audio = PlayoutAudioTrack(fps, self.audio_queue)
        self.clock = ClockSync()
        self.channel = None
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    # Pump thread -> this peer
    def on_frame(self, frame: AVFrame, t: float) -> None:
        self.video_queue.put_threadsafe(frame)
        self.audio_queue.put_threadsafe(frame)

    def on_speaking(self, turn_id: int, t: float) -> None:
        self.loop.call_soon_threadsafe(self._send, {"type": "speaking", "turn": turn_id,
                                                    "released_ms": self.clock.to_browser_ms(t)})

    def on_barge_in(self, turn_id: int) -> None:
        self.loop.call_soon_threadsafe(self._send, {"type": "barge_in", "turn": turn_id})

    def _send(self, message: dict) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(message))

    async def answer(self, sdp: str, kind: str) -> RTCSessionDescription:
        pc = self.pc

        @pc.on("datachannel")
        def on_datachannel(channel) -> None:
            self.channel = channel
            channel.on("message", self._on_message)
            self.tasks.append(asyncio.ensure_future(self._ping()))

        @pc.on("track")
        def on_track(track) -> None:
            if track.kind == "audio":
                self.tasks.append(asyncio.ensure_future(self._read_mic(track)))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                await self.close()

        await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type=kind))
        pc.addTrack(self.video)
        pc.addTrack(self.audio)
        await pc.setLocalDescription(await pc.createAnswer())
        self.live.add_listener(self.on_frame, self.on_speaking, self.on_barge_in)
        return pc.localDescription

    async def _read_mic(self, track) -> None:
        """Browser microphone -> the voice loop, resampled to 16 kHz mono as it arrives."""
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            for out in resampler.resample(frame):
                try:
                    self.live.feed_mic(out.to_ndarray().reshape(-1), SAMPLE_RATE)
                except ValueError as e:  # a malformed chunk is dropped; the stream goes on
                    log.warning("microphone chunk rejected: %s", e)

    async def _ping(self) -> None:
        while not self.closed:
            self._send({"type": "ping", "sent": time.monotonic()})
            await asyncio.sleep(0.25 if self.clock.best_rtt > 0.01 else 2.0)

    def _on_message(self, raw: str) -> None:
        try:
            message = json.loads(raw)
            kind = message.get("type")
            if kind == "pong":
                self.clock.sample(float(message["sent"]), time.monotonic(), float(message["browser_ms"]))
            elif kind == "delivered":
                for stamp, key in (("client_delivered", "audio_ms"), ("client_frame_shown", "frame_ms")):
                    if message.get(key) is not None:
                        t = self.clock.to_monotonic(float(message[key]))
                        if t is not None:
                            self.live.mark_turn(int(message["turn"]), stamp, t)
            elif kind == "av_sync":
                self.live.av_offsets_ms.append(float(message["offset_ms"]))
            elif kind == "error":
                self.controller.client_error = str(message.get("message", "the browser reported an error"))[:500]
        except (ValueError, KeyError, TypeError) as e:
            log.warning("bad message from the browser: %s (%r)", e, raw[:200])

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.live.remove_listener(self.on_frame, self.on_speaking, self.on_barge_in)
        for task in self.tasks:
            task.cancel()
        await self.pc.close()
