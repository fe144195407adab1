"""Run a module with extra packages from a folder appended to sys.path (the interpreter's own packages win).

    python3 lab/device/with_site.py /tmp/site lab.voice_bench --device cpu --json
    python3 lab/device/with_site.py --first /tmp/site lab.app_bench --json

PYTHONPATH would put the folder first, letting its copies of torch's own dependencies shadow the ones torch
was built with; `site.addsitedir` appends it instead. `--first` puts it before the interpreter's
site-packages (never before the standard library): for a folder holding a set resolved together (the app's
packages) that the machine's older copies of a few of them must not break up.
"""

from __future__ import annotations

import os
import runpy
import site
import sys


def main() -> None:
    argv = sys.argv[1:]
    first = bool(argv) and argv[0] == "--first"
    argv = argv[1:] if first else argv
    if len(argv) < 2:
        raise SystemExit("usage: with_site.py [--first] FOLDER MODULE [ARGS...]")
    folder, module, args = argv[0], argv[1], argv[2:]
    sys.path[0] = os.getcwd()  # as `python -m` does: the working directory, not this script's folder
    before = list(sys.path)
    site.addsitedir(folder)
    if first:
        added = [p for p in sys.path if p not in before]
        rest = [p for p in sys.path if p not in added]
        at = next((i for i, p in enumerate(rest) if p.endswith(("site-packages", "dist-packages"))), len(rest))
        sys.path[:] = rest[:at] + added + rest[at:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
