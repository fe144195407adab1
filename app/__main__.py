"""talkloop: talk to the character in the browser.

    talkloop                       # http://127.0.0.1:7860
    python -m app --config talkloop.yaml --device cpu --record

Settings come from defaults, then the YAML file given with --config, then flags.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.config import AppConfig, build_config


def parse_args(argv: list[str] | None) -> tuple[str | None, dict]:
    p = argparse.ArgumentParser(prog="talkloop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of settings (keys as in app/config.py: spec, preset, agent, ...)")
    p.add_argument("--host", help=f"address to serve on (default {AppConfig.host})")
    p.add_argument("--port", type=int, help=f"port (default {AppConfig.port})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="engine and voice models device (default auto)")
    p.add_argument("--spec", help="engine model spec (default demo)")
    p.add_argument("--weights", help="engine checkpoint (default: the one shipped for the spec)")
    p.add_argument("--gpus", help="placement: diffusion GPUs, one process each, e.g. 0,1,2")
    p.add_argument("--decoder-gpu", help="placement: GPU(s) that only decode, e.g. 3")
    p.add_argument("--tp", type=int, help="placement without GPUs: tensor-parallel degree in CPU processes")
    p.add_argument("--transport", choices=("webrtc", "hls"),
                   help="video to the browser: webrtc (default) or hls (Gradio's streaming video; a fallback, seconds behind)")
    p.add_argument("--audio-input", choices=("browser", "local"), help="microphone: the browser's (default) or this machine's")
    p.add_argument("--record", action="store_true", default=None, help="record every session (MP4 + trace + transcript)")
    p.add_argument("--recordings-dir", help="where recorded sessions go")
    p.add_argument("--preset", help="character preset at start")
    args = vars(p.parse_args(argv))
    return args.pop("config"), args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config_path, overrides = parse_args(argv)
    try:
        config = build_config(config_path, overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from app.controller import Controller
    from app.server import serve

    controller = Controller(config)
    for failure in controller.failures():
        print(f"warning: {failure}", file=sys.stderr)
    print(f"talkloop: http://{config.host}:{config.port}  (engine: {controller.health()})", file=sys.stderr, flush=True)
    serve(controller)
    return 0


if __name__ == "__main__":
    sys.exit(main())
