"""Connector name -> class, imported on first use (a store's client library loads only when it is chosen)."""
from __future__ import annotations

import importlib

from surge.config import EngineConfig
from surge.core.kv_cache.spec import KVCacheConfig
from surge.kv_transfer.base import KVConnectorBase, KVConnectorRole

_CONNECTORS: dict[str, str | type[KVConnectorBase]] = {
    "OffloadingConnector": "surge.kv_transfer.offload:OffloadingConnector",
    "MooncakeStoreConnector": "surge.kv_transfer.mooncake_store:MooncakeStoreConnector",
    "MooncakeTransferConnector": "surge.kv_transfer.transfer_connector:MooncakeTransferConnector",
}


def register_connector(name: str, cls: type[KVConnectorBase]) -> None:
    _CONNECTORS[name] = cls


def connector_class(config: EngineConfig) -> type[KVConnectorBase]:
    tc = config.kv_transfer_config
    if tc.kv_connector_module_path is not None:
        try:
            importlib.import_module(tc.kv_connector_module_path)
        except ImportError as e:
            raise ValueError(f"kv_transfer_config.kv_connector_module_path={tc.kv_connector_module_path!r} cannot "
                             f"be imported: {e}") from None
    entry = _CONNECTORS.get(tc.kv_connector)
    if entry is None:
        raise ValueError(f"kv_transfer_config.kv_connector={tc.kv_connector!r} is unknown; known: "
                         f"{', '.join(sorted(_CONNECTORS))}")
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = _CONNECTORS[tc.kv_connector] = getattr(importlib.import_module(module), name)
    return entry


def create_connector(config: EngineConfig, role: KVConnectorRole,
                     kv_cache_config: KVCacheConfig) -> KVConnectorBase | None:
    """The connector's instance for one side, or None when the engine has none."""
    if config.kv_transfer_config is None:
        return None
    return connector_class(config)(config, role, kv_cache_config)
