"""Process titles for operators and tests (`ps`, `top`): `mmserve::api_server_<i>`,
`mmserve::engine_dp<r>`, `mmserve::worker_dp<r>_tp<t>`."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def set_process_title(name: str) -> None:
    """Title this process `mmserve::<name>` (a no-op, logged once, without setproctitle)."""
    try:
        import setproctitle
    except ImportError:
        logger.debug("setproctitle is not installed; the process keeps its title")
        return
    setproctitle.setproctitle(f"mmserve::{name}")
