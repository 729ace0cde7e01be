"""ECMooncakeStoreConnector: embeddings in a Mooncake distributed store (the one `surge kv-store serve` runs for
the KV's MooncakeStoreConnector), moved by Mooncake's transfer engine, keyed by the model's digest and the image's
content hash. Each value is a safetensors payload (shape and dtype travel with the bytes; nothing is pickled).
The encoder instance's save is complete when it returns (a failed one fails the encoder request, so the proxy's
fallback takes over); the prefill instance's load is bounded in time, and a store that is down or slow makes it
encode locally (counted), tried again after retry_interval_s.

ec_connector_extra_config takes the MooncakeStoreSettings keys (master, metadata_server, local_hostname, protocol,
global_segment_size, local_buffer_size, transfer_timeout_s, connect_timeout_s, retry_interval_s)."""
from __future__ import annotations

import torch
from safetensors.torch import load, save

from surge.config import EngineConfig
from surge.ec_transfer.base import ECConnectorBase
from surge.kv_transfer.mooncake_store import MooncakeStoreSettings, StoreClient

_OBJECT_ALREADY_EXISTS = -705  # the same image saved before: its embeddings are the same bytes


class ECMooncakeStoreConnector(ECConnectorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.settings = MooncakeStoreSettings.from_extra_config(self.extra)
        self.client = StoreClient(self.settings, "encoder cache")
        self.client.connect(self.settings.connect_timeout_s)

    def key(self, identifier: str) -> str:
        return f"surge-ec/{self.prefix}/{identifier}"

    def save(self, identifier: str, embeds: torch.Tensor) -> None:
        value = save({"embeds": embeds.detach().to("cpu").contiguous()})
        key = self.key(identifier)
        rc = self.client.call(lambda: self.client.store.put(key, value), self.settings.transfer_timeout_s)
        if rc is None or rc not in (0, _OBJECT_ALREADY_EXISTS):
            raise RuntimeError(f"ECMooncakeStoreConnector: saving {key} to the Mooncake store at "
                               f"{self.settings.master} failed ({'unavailable' if rc is None else rc})")

    def load(self, identifier: str, device: torch.device) -> torch.Tensor | None:
        key = self.key(identifier)
        data = self.client.call(lambda: self.client.store.get(key), self.settings.transfer_timeout_s)
        if not data:  # missing (empty bytes) or the store cannot answer
            return None
        try:
            return load(bytes(data))["embeds"].to(device)
        except Exception as e:  # noqa: BLE001 (a foreign or torn value: encode locally)
            self.client.fail(f"{key} is not an embeddings payload ({e})")
            return None

    def shutdown(self) -> None:
        self.client.close(self.settings.connect_timeout_s)
