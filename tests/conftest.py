"""Fixtures shared by every test package."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF directory; converted once per SURGE_CACHE_DIR."""
    from surge.model.loader.default_model import default_model_path

    return default_model_path()
