"""The web server: Gradio's page and the WebRTC signalling routes on one FastAPI app,
served by uvicorn; on exit the live session, the voice loop and the engine are closed."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
from pathlib import Path

# Gradio reports usage to its makers unless told not to; this app talks to nobody.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.staticfiles import StaticFiles  # noqa: E402

from app.controller import Controller  # noqa: E402

log = logging.getLogger(__name__)
STATIC = Path(__file__).resolve().parent / "static"


def build_api(controller: Controller) -> FastAPI:
    peers: set = set()

    @contextlib.asynccontextmanager
    async def lifespan(_api: FastAPI):
        yield
        for peer in list(peers):  # on shutdown: close the browser's WebRTC connection
            await peer.close()

    api = FastAPI(title="talkloop", lifespan=lifespan)

    @api.get("/talkloop/client-config")
    async def client_config() -> dict:
        config = controller.config
        return {"audio_input": config.audio_input, "microphone": config.microphone_constraints(),
                "interruption_ms": config.client_interruption_ms}

    @api.post("/talkloop/offer")
    async def offer(request: Request):
        from app.rtc import Peer

        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("sdp"), str) or body.get("type") != "offer":
            return JSONResponse({"error": "expected a JSON offer: {sdp, type: 'offer'}"}, status_code=400)
        live = controller.live
        if live is None:
            return JSONResponse({"error": "no live session: press Start"}, status_code=409)
        for old in list(peers):  # one viewer at a time: a new connection replaces the old one
            await old.close()
            peers.discard(old)
        peer = Peer(controller, live, asyncio.get_running_loop())
        peers.add(peer)
        try:
            answer = await peer.answer(body["sdp"], body["type"])
        except Exception as e:  # an offer the WebRTC stack cannot answer (aiortc: "None is not in list" for garbage)
            log.warning("could not answer a WebRTC offer: %r", e)
            peers.discard(peer)
            await peer.close()  # its half-made connection and tasks go now, not at the next offer
            return JSONResponse({"error": f"could not answer the offer (not a WebRTC offer this server can take): {e}"},
                                status_code=400)
        return {"sdp": answer.sdp, "type": answer.type}

    @api.post("/talkloop/client-error")
    async def client_error(request: Request) -> dict:
        body = await request.json()
        message = str(body.get("message", "the browser reported an error")) if isinstance(body, dict) else "bad report"
        controller.client_error = message[:500]
        return {"ok": True}

    api.mount("/talkloop/static", StaticFiles(directory=STATIC), name="talkloop-static")
    return api


def build_app(controller: Controller):
    """The ASGI app: signalling routes, then Gradio's page at /; recordings may be served for replay.

    Then every object made so far (the models, the page, the libraries) is frozen out of the garbage collector's
    full passes (gc.freeze): a full pass over them holds every Python thread, the engine's step and the media loop
    among them, long enough to miss frames. The collector still frees what sessions make."""
    import gradio as gr

    from app.ui import build_ui, page_settings

    recordings = recordings_folder(controller.config.recordings_dir)
    with contextlib.redirect_stdout(sys.stderr):  # mount_gradio_app prints; stdout is for --json output
        app = gr.mount_gradio_app(build_api(controller), build_ui(controller), path="/", allowed_paths=[str(recordings)],
                                  **page_settings())
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many apps a process builds
    atexit.register(gc.unfreeze)  # at exit all is collectable again, as the interpreter's last pass expects
    return app


def recordings_folder(recordings_dir: str) -> Path:
    """The recordings folder, made if missing (replay lists it whether or not this run records); a ValueError
    naming the setting when it cannot be one."""
    path = Path(recordings_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"recordings_dir {str(path)!r} is a file, not a folder; choose another with --recordings-dir") from None
    except OSError as e:  # a file where a parent folder should be, no permission, a read-only disk
        raise ValueError(f"recordings_dir {str(path)!r} cannot be made: {e.strerror}; choose another with --recordings-dir") from None
    return path


def check_can_listen(host: str, port: int) -> None:
    """ValueError naming the port when host:port cannot be bound (taken, or not this machine's address).
    Binds each address as uvicorn's event loop will (SO_REUSEADDR: a port left in TIME_WAIT is free), then lets go."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on host {host!r}: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"port {port} on {host} is already in use; choose another with --port") from None
                raise ValueError(f"cannot serve on {host}:{port}: {e.strerror}") from None


def serve(controller: Controller) -> None:
    """Run until interrupted (Ctrl-C / SIGTERM), then close everything."""
    import uvicorn

    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal under the handler
    # that was there before: make that an ordinary exit so the engine and voice loop are closed below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # the engine and voice loop are already up: closed below however building the page or serving ends
        app = build_app(controller)
        server = uvicorn.Server(uvicorn.Config(app, host=controller.config.host, port=controller.config.port, log_level="warning"))
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        controller.close()
