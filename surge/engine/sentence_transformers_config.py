"""A sentence-transformers checkpoint's own files, read as vLLM reads them: `modules.json` lists the modules,
`<Pooling path>/config.json` says how to pool (pooling_mode_lasttoken / mean_tokens / cls_token), a Normalize
module means L2-normalized embeddings, and `config_sentence_transformers.json` holds the prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

from surge.config import PoolerConfig

# The pooling modes Surge implements, by sentence-transformers' names: `pooling_mode` (6.x) or the older
# `pooling_mode_<name>: true` keys.
_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS", "cls_token": "CLS"}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_pooler_config(model_dir: str | Path) -> PoolerConfig | None:
    """The checkpoint's pooling (None: it has no modules.json). A pooling mode Surge lacks is refused by name."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    # A module's class by its last name: "sentence_transformers.models.Pooling" (5.x) and
    # "sentence_transformers.sentence_transformer.modules.pooling.Pooling" (6.x) alike.
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = None
    if "Pooling" in types:
        pooling_file = Path(model_dir) / types["Pooling"].get("path", "") / "config.json"
        config = _read_json(pooling_file) if pooling_file.is_file() else {}
        modes = config.get("pooling_mode")
        modes = [modes] if isinstance(modes, str) else list(modes or [])
        modes += [key.removeprefix("pooling_mode_") for key, value in config.items()
                  if key.startswith("pooling_mode_") and value is True]
        if len(set(modes)) > 1 or any(m not in _POOLING_MODES for m in modes):
            raise ValueError(f"{pooling_file}: pooling {modes} is not supported; one of "
                             f"{', '.join(sorted(_POOLING_MODES))}")
        pooling_type = _POOLING_MODES[modes[0]] if modes else None
    return PoolerConfig(pooling_type=pooling_type, normalize="Normalize" in types)


def default_prompt(model_dir: str | Path) -> str:
    """The prompt sentence-transformers puts before every text by default (`default_prompt_name`), or ""."""
    path = Path(model_dir) / "config_sentence_transformers.json"
    if not path.is_file():
        return ""
    config = _read_json(path)
    name = config.get("default_prompt_name")
    return (config.get("prompts") or {}).get(name, "") if name else ""
