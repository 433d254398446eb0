"""Negative controls for the end-to-end tests (never for serving). A D connector that reports
every load finished without moving a byte: served tokens then come from whatever D's blocks
held, so a test that cannot tell this connector from the real one proves nothing. A P connector
that corrupts the KV it sends after taking its checksum: with `verify` on, D must catch every
such load. vLLM loads them by module path (``kv_connector_module_path:
kvfsm.vllm.negative_control``), so they live in the package."""

from __future__ import annotations

from typing import Any

from kvfsm.core import Admit
from kvfsm.runtime import corrupt_after_checksum
from kvfsm.vllm import KvfsmConnector, KvfsmMetadata


class SkippingKvfsmConnector(KvfsmConnector):
    """`KvfsmConnector` whose D worker skips every transfer and claims success."""

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata
        assert isinstance(connector_metadata, KvfsmMetadata)
        worker = self._need_worker()
        for event, awaited in connector_metadata.step.events:
            if awaited and isinstance(event, Admit):
                with worker._lock:
                    worker._recving.add(event.request_id)


class CorruptingKvfsmConnector(KvfsmConnector):
    """`KvfsmConnector` whose P worker flips a byte of every transfer's KV right after taking its
    checksum: the bytes that reach D are not the ones summed."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        engine = self._need_worker().engine
        if engine is not None:
            engine.checksum = corrupt_after_checksum(times=1 << 30)
