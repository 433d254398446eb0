"""Asking a peer what became of a transfer whose completion notification never came
(docs/lifecycles.md, "Lost completions"): when to ask, whom, and taking the answer. `Side` runs
it; each side says what it answers, what it asks about and before which bound."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvfsm.core._config import CoreConfig
from kvfsm.core._deadlines import Deadlines
from kvfsm.core._io import AskPeer, Command, PeerAnswered, TransferStatus
from kvfsm.core._records import Request

__all__ = ["PeerQuestions"]


class PeerQuestions:
    """The questions part of a side (a mixin of `Side`, whose state it uses)."""

    config: CoreConfig
    counters: Counter[str]
    requests: dict[str, Request]
    deadlines: Deadlines
    queries: Deadlines
    _now: float

    def _emit(self, command: Command) -> None:
        raise NotImplementedError

    def transfer_status(
        self, asker: str, asker_request_id: str, request_id: str = ""
    ) -> TransferStatus:
        """What this side can say of its transfer with `asker` for the request `asker` calls
        `asker_request_id` (ours: `request_id`, if it knows it). A read: it changes nothing,
        and says "done" only of a transfer that completed."""
        raise NotImplementedError

    def _on_peer_answered(self, event: PeerAnswered) -> None:
        self.counters[f"status_{event.status}"] += 1
        req = self.requests.get(event.request_id)
        if req is None or event.peer not in req.links or event.peer in req.tally.reported:
            self.counters["status_late"] += 1  # the completion or a bound came first
            return
        self._take_answer(req, event.peer, event.status)

    def _take_answer(self, req: Request, peer: str, status: TransferStatus) -> None:
        raise NotImplementedError

    def _asks_about(self, link: Any) -> bool:
        """Whether the peer of `link` has something of ours under way to answer for."""
        raise NotImplementedError

    def _ask_bound_s(self) -> float:
        raise NotImplementedError

    def _req_cmd_arm_ask(self, req: Request) -> None:
        # Before the bound now armed (the watchdog may date from the admission), never earlier
        # than now.
        bound = self._ask_bound_s()
        margin = self.config.ask_margin(bound)
        if margin is not None:
            deadline = self.deadlines.at(req.id)
            at = (self._now + bound if deadline is None else deadline) - margin
            self.queries.arm(req.id, max(at, self._now), "completion_overdue")

    def _req_cmd_ask_peer(self, req: Request) -> None:
        for link in req.links.values():
            if link.agent not in req.tally.reported and self._asks_about(link):
                self.counters["status_asked"] += 1
                self._emit(AskPeer(link.agent, req.id, link.request_id))
