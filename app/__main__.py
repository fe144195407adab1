"""talkloop: talk to the character in the browser.

    talkloop                       # http://127.0.0.1:7860
    python -m app --config talkloop.yaml --device cpu --record

Settings come from defaults, then the YAML file given with --config, then flags.
Each flag below is a setting; its YAML key is the same name with underscores.
"""

from __future__ import annotations

import argparse
import logging
import sys

from app.config import add_flags, build_config


def parse_args(argv: list[str] | None) -> tuple[str | None, dict]:
    p = argparse.ArgumentParser(prog="talkloop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file of settings (the keys are the flags' names: spec, preset, agent, ...)")
    add_flags(p)
    args = vars(p.parse_args(argv))
    return args.pop("config"), args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config_path, overrides = parse_args(argv)
    from app.controller import Controller
    from app.server import check_can_listen, recordings_folder, serve

    try:
        config = build_config(config_path, overrides)
        check_can_listen(config.host, config.port)  # before the models load (uvicorn still reports a port taken since)
        recordings_folder(config.recordings_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    controller = Controller(config)
    for failure in controller.failures():
        print(f"warning: {failure}", file=sys.stderr)
    print(f"talkloop: http://{config.host}:{config.port}  (engine: {controller.health()})", file=sys.stderr, flush=True)
    serve(controller)
    return 0


if __name__ == "__main__":
    sys.exit(main())
