"""The load_format -> loader table, and `load_model`, the engine's one loading seam: it picks the loader and owns
the fallback to disk. The disk loaders ("safetensors", "dummy") register here; the weight cache in its own package.

A loader that cannot serve raises LoaderUnavailable with the reason; `load_model` then warns and loads from disk,
or, with fallback off, raises the loader's error with that reason.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from surge.config import EngineConfig, ModelConfig
from surge.distributed.parallel_state import get_tp_group
from surge.logger import init_logger
from surge.model.layers.linear import deferred_weights
from surge.model.quant import get_quant_config, quantize_model
from surge.model.loader.safetensors_loader import init_dummy_weights, iterate_safetensors, load_weights
from surge.model.models.registry import get_model_class

logger = init_logger(__name__)

# The engine's config and this rank's device -> this rank's model, post-load processing done.
Loader = Callable[[EngineConfig, torch.device], nn.Module]

_LOADERS: dict[str, Loader] = {}


class LoaderUnavailable(Exception):
    """A loader cannot serve this rank; the message is the reason, written for people. Subclasses name their loader
    (`source`, as the warning says it) and the error raised instead when fallback is off."""
    source = "the loader"
    error: type[Exception] = RuntimeError


def register_loader(name: str) -> Callable[[Loader], Loader]:
    def register(loader: Loader) -> Loader:
        if name in _LOADERS:
            raise ValueError(f"load_format={name!r} is registered twice ({_LOADERS[name].__module__} and "
                             f"{loader.__module__})")
        _LOADERS[name] = loader
        return loader
    return register


def load_formats() -> tuple[str, ...]:
    """The registered formats, in registration order (disk first)."""
    return tuple(_LOADERS)


def get_loader(name: str) -> Loader:
    if name not in _LOADERS:
        raise ValueError(f"load_format={name!r} is not supported; choose {', '.join(load_formats())}")
    return _LOADERS[name]


def build_model(config: ModelConfig, device: torch.device, cls: type[nn.Module] | None = None) -> nn.Module:
    """The model on `device`, its linear layers' parameters those of its quantization (surge/model/quant). cls:
    another class built from the same config and checkpoint (a target's MTP draft); None: the architecture's."""
    cls = cls or get_model_class(config.architecture, config.runner)
    quant = get_quant_config(config.quantization_config, config.quantization)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device), (deferred_weights() if quant is not None else nullcontext()):
            model = cls(config)
        model_dir = config.model if config.load_format != "dummy" and Path(config.model).is_dir() else None
        quantize_model(model, quant, device, model_dir)
    finally:
        torch.set_default_dtype(old_dtype)
    if quant is not None and device.type != "meta":
        logger.info("quantization: %s", quant.describe())
    return model.eval()


def load_from_disk(config: ModelConfig, device: torch.device, seed: int = 0,
                   cls: type[nn.Module] | None = None) -> nn.Module:
    """Built (as build_model's cls), then filled from the checkpoint (or randomly for load_format="dummy")."""
    model = build_model(config, device, cls)
    if config.load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, iterate_safetensors(config.model), config.model)
    return model


@register_loader("dummy")
@register_loader("safetensors")  # the lower decorator runs first: "safetensors" leads the list of formats
def _load_from_disk(config: EngineConfig, device: torch.device) -> nn.Module:
    return load_from_disk(config.model_config, device, config.seed)


def load_model(config: EngineConfig, device: torch.device) -> nn.Module:
    """The model as the engine runs it, on `device` (this rank's shard, post-load processing done)."""
    try:
        return get_loader(config.model_config.load_format)(config, device)
    except LoaderUnavailable as e:
        rank = get_tp_group().rank
        # The weight cache is the one loader that can be unavailable; its config holds the switch.
        if not config.weight_cache_config.fallback:
            raise e.error(f"{e.source} cannot serve rank {rank}: {e} (fallback is off)") from None
        logger.warning("%s cannot serve rank %d: %s; loading from disk instead", e.source, rank, e)
        return load_from_disk(config.model_config, device, config.seed)
