"""ECSharedStorageConnector: embeddings as safetensors files in a directory both instances see (on one host,
/dev/shm makes it shared memory; across hosts, a shared file system). The encoder writes each file whole, then
renames it into place, so a reader sees a complete file or none; it keeps the newest `max_entries` files it wrote.
The CPU-testable connector, as vLLM's example EC connector is; the Mooncake store one moves the same bytes over
Mooncake's transfer engine."""
from __future__ import annotations

import collections
import os
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from surge.config import EngineConfig
from surge.ec_transfer.base import ECConnectorBase, refuse_unknown
from surge.logger import init_logger

logger = init_logger(__name__)


class ECSharedStorageConnector(ECConnectorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        refuse_unknown("ECSharedStorageConnector", self.extra, ("shared_storage_path", "max_entries"))
        path = self.extra.get("shared_storage_path")
        if not (isinstance(path, str) and path):
            raise ValueError("ECSharedStorageConnector needs ec_connector_extra_config['shared_storage_path'], a "
                             "directory both the encoder and the prefill instance see")
        self.max_entries = self.extra.get("max_entries", 4096)
        if isinstance(self.max_entries, bool) or not (isinstance(self.max_entries, int) and self.max_entries > 0):
            raise ValueError(f"ECSharedStorageConnector: ec_connector_extra_config['max_entries']="
                             f"{self.max_entries!r} must be a positive integer")
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._written: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest first

    def _path(self, identifier: str) -> Path:
        return self.root / f"{self.key(identifier)}.safetensors"

    def save(self, identifier: str, embeds: torch.Tensor) -> None:
        path = self._path(identifier)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        save_file({"embeds": embeds.detach().to("cpu").contiguous()}, str(tmp))
        os.replace(tmp, path)
        self._written.pop(identifier, None)
        self._written[identifier] = None
        while len(self._written) > self.max_entries:
            old, _ = self._written.popitem(last=False)
            self._path(old).unlink(missing_ok=True)

    def load(self, identifier: str, device: torch.device) -> torch.Tensor | None:
        path = self._path(identifier)
        try:
            return load_file(str(path), device=str(device))["embeds"]
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 (a torn or foreign file: encode locally)
            logger.warning("EC connector: reading %s failed (%s); the image is encoded here", path, e)
            return None
