"""Prometheus metrics of the connector, fed by vLLM with each `KvfsmStats` window."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

__all__ = ["KvfsmPromMetrics"]


class KvfsmPromMetrics(KVConnectorPromMetrics):
    """`vllm:kvfsm_*` counters: requests by final state, transfers, failed transfers, bytes,
    bugs contained (`internal_errors`), and seconds spent in each lifecycle state (labelled
    `state`)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        self._requests = counter(
            name="vllm:kvfsm_requests",
            documentation="kvfsm requests that ended, by final state.",
            labelnames=[*labelnames, "state"],
        )
        self._counts = {
            name: counter(name=f"vllm:kvfsm_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in (
                ("transfers", "NIXL transfers kvfsm posted."),
                ("failed_transfers", "kvfsm transfers that failed."),
                ("bytes", "Bytes of the kvfsm transfers that completed."),
                (
                    "internal_errors",
                    "Bugs kvfsm contained: each logged, the requests it hit failed safely.",
                ),
                (
                    "refused_notifications",
                    "Notifications refused: replays, unauthenticated, or from strangers.",
                ),
                (
                    "corrupted",
                    "Transfers whose bytes failed their checksum (verify): blocks reported invalid.",
                ),
                (
                    "verified",
                    "Transfers whose bytes matched their checksum (verify).",
                ),
                (
                    "recovered",
                    "Transfers whose completion was lost, found done by asking the peer.",
                ),
                ("goodbyes", "Goodbyes heard: a peer engine drained or closed."),
                (
                    "peers_removed",
                    "Peer NIXL agents unloaded (goodbye, loss, idle TTL, re-handshake).",
                ),
            )
        }
        gauge = self._gauge_cls
        self._drained = gauge(
            name="vllm:kvfsm_drained",
            documentation="1 once every rank of the engine drained (nothing live, peers told"
            " goodbye: safe to stop); 0 while serving or draining.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._draining = gauge(
            name="vllm:kvfsm_draining",
            documentation="1 while the engine drains or is drained (it takes no new KV"
            " hand-offs); 0 while serving.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        for labels in per_engine_labelvalues.values():
            self._drained.labels(*labels).set(0)
            self._draining.labels(*labels).set(0)
        self._seconds = counter(
            name="vllm:kvfsm_seconds_in_state",
            documentation="Seconds kvfsm requests spent in each lifecycle state.",
            labelnames=[*labelnames, "state"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        for state, n in data.get("ended", {}).items():
            self._requests.labels(*labels, state).inc(n)
        for name, metric in self._counts.items():
            if value := data.get("counts", {}).get(name, 0):
                metric.labels(*labels).inc(value)
        for state, seconds in data.get("seconds", {}).items():
            self._seconds.labels(*labels, state).inc(seconds)
        if engines := data.get("engines"):
            self._draining.labels(*labels).set(1)
            self._drained.labels(*labels).set(int(set(engines) == {"drained"}))
