"""The README's table of supported architectures is the registry's, and every registered class keeps the
architecture contract (surge/model/arch.py)."""
from __future__ import annotations

import re
from pathlib import Path

from surge.model.arch import CausalLM
from surge.model.models.registry import MODEL_REGISTRY, architectures_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_exactly_the_registry():
    text = README.read_text()
    block = re.search(r"<!-- architectures:[^\n]*-->\n(.*?)<!-- /architectures -->", text, re.S)
    assert block is not None, "README.md lost its generated architectures block"
    assert block.group(1) == architectures_markdown(), "regenerate it with `python -m surge.model.models`"


def test_every_model_keeps_the_contract():
    for arch, cls in MODEL_REGISTRY.items():
        assert issubclass(cls, CausalLM), arch
        assert cls.__module__.startswith("surge.model.models."), arch
