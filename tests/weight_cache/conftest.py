"""Fixtures of the weight-cache tests: tiny checkpoints, a daemon in this process, a log of the engine's loader."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tiny_models import make_tiny_model
from weight_cache_daemons import running_daemon


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("wc-llama") / "m")


@pytest.fixture(scope="session")
def tied_dir(tmp_path_factory) -> Path:
    return make_tiny_model("llama-tied", tmp_path_factory.mktemp("wc-tied") / "m")


@pytest.fixture
def daemon(tied_dir, tmp_path):
    with running_daemon(tied_dir, tmp_path / "sockets") as d:
        yield d


@pytest.fixture
def loader_log():
    """Messages of the weight-cache loader and of load_model's fallback in this process (the surge logger does not
    propagate to pytest)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("surge.weight_cache.ipc_loader", "surge.model.loader.base")]
    for logger in loggers:
        logger.addHandler(handler)

    class Log:
        def take(self) -> str:
            text = "\n".join(r.getMessage() for r in records)
            records.clear()
            return text

    try:
        yield Log()
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
