"""`python -m benchmarks [--only NAME] [--list]`: every component benchmark here, as `mmserve bench components`."""

from __future__ import annotations

import sys
from pathlib import Path

from mmserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "components", "--dir", str(Path(__file__).resolve().parent), *sys.argv[1:]]))
