"""Run a module with extra packages from a folder appended to sys.path (the interpreter's own packages win).

    python3 tools/with_site.py /tmp/site voice.bench --device cpu --json

PYTHONPATH would put the folder first, letting its copies of torch's own dependencies shadow the ones torch
was built with; `site.addsitedir` appends it instead.
"""

from __future__ import annotations

import os
import runpy
import site
import sys


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: with_site.py FOLDER MODULE [ARGS...]")
    folder, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path[0] = os.getcwd()  # as `python -m` does: the working directory, not this script's folder
    site.addsitedir(folder)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
