"""Fixtures shared by every test package.

Without CUDA, Triton runs its interpreter (tests/kernels), which it decides when triton.language is first imported:
the standard library's @triton.jit functions (tl.sum, tl.max ...) are then interpreted or not for the whole process.
Any test module may import triton first (surge.worker.model_runner imports two kernel modules), so the variable is
set here, before every test module is collected; otherwise interpreted kernels fail calling tl.sum with "Cannot call
@triton.jit'd outside of the scope of a kernel" (the full suite did, the kernel tests alone did not)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as an HF directory; converted once per SURGE_CACHE_DIR."""
    from surge.model.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a ChatML chat template (its byte tokenizer has none of its own)."""
    from remote_server import add_chat_template
    from tiny_models import make_tiny_model

    return add_chat_template(make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """`surge serve` on the tiny model, started once per session; API key "test-key", names tiny and tiny-alias."""
    from remote_server import RemoteServer

    args = ("--served-model-name", "tiny", "tiny-alias", "--max-model-len", "512", "--kv-cache-memory",
            str(32 << 20))
    with RemoteServer(tiny_model_dir, *args, api_key="test-key") as server:
        yield server
