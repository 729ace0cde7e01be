"""EC connector name -> class, imported on first use (a store's client library loads only when it is chosen)."""
from __future__ import annotations

import importlib

from surge.config import EngineConfig
from surge.ec_transfer.base import ECConnectorBase

_CONNECTORS: dict[str, str] = {
    "ECSharedStorageConnector": "surge.ec_transfer.shared_storage:ECSharedStorageConnector",
    "ECMooncakeStoreConnector": "surge.ec_transfer.mooncake_store:ECMooncakeStoreConnector",
}


def create_ec_connector(config: EngineConfig) -> ECConnectorBase | None:
    """The worker rank's connector, or None when the engine encodes every image itself."""
    tc = config.ec_transfer_config
    if tc is None:
        return None
    entry = _CONNECTORS.get(tc.ec_connector)
    if entry is None:
        raise ValueError(f"ec_transfer_config.ec_connector={tc.ec_connector!r} is unknown; known: "
                         f"{', '.join(sorted(_CONNECTORS))}")
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)(config)
