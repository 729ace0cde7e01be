"""The `surge` logger: one handler, level from SURGE_LOG_LEVEL."""
from __future__ import annotations

import logging

from surge import envs

_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger("surge")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.SURGE_LOG_LEVEL)
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
