"""Process titles for operators and tests (`ps`, `top`): `mmserve::api_server_<i>`,
`mmserve::engine_dp<r>`, `mmserve::worker_dp<r>_tp<t>`."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def set_process_title(name: str) -> None:
    """Title this process `mmserve::<name>` (a no-op, logged once, without setproctitle). In a Ray
    worker (an engine core under `--data-parallel-backend ray`) Ray's own copy of setproctitle
    holds the title, and the pip one cannot take it: Ray's sets it there."""
    title = f"mmserve::{name}"
    try:
        import setproctitle
    except ImportError:
        logger.debug("setproctitle is not installed; the process keeps its title")
        return
    setproctitle.setproctitle(title)
    raylet = sys.modules.get("ray._raylet")
    if setproctitle.getproctitle() != title and raylet is not None:
        raylet.setproctitle(title)
