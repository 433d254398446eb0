"""A negative control for the end-to-end tests (never for serving): a D connector that reports every load finished
without moving a byte. Served tokens then come from whatever D's blocks held, so a test that
cannot tell this connector from the real one proves nothing. vLLM loads it by module path
(``kv_connector_module_path: kvfsm.vllm.negative_control``), so it lives in the package."""

from __future__ import annotations

from typing import Any

from kvfsm.core import Admit
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
