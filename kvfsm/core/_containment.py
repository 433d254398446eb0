"""What a side needs to contain a bug: which live requests it hit, and a short traceback for the
log (the runtime's loop and engine use the same)."""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any

from kvfsm.core._records import Peer, Request, TransferTally

__all__ = ["requests_hit", "short_trace"]

_TRACE_FRAMES = 8


def requests_hit(requests: dict[str, Request], instances: Iterable[Any]) -> dict[str, Request]:
    """The live requests a failed step hit: a request whose step raised, the request of a tally
    whose step did, or every request using a peer whose step did."""
    found: dict[str, Request] = {}
    for inst in instances:
        if isinstance(inst, Peer):
            found.update((r.id, r) for r in requests.values() if inst.id in r.peers)
            continue
        req = requests.get(inst.id)
        if req is not None and (req is inst or isinstance(inst, TransferTally)):
            found[req.id] = req
    return found


def short_trace(exc: BaseException) -> str:
    """The exception with its innermost frames, for a log line."""
    return "".join(traceback.format_exception(exc, limit=-_TRACE_FRAMES))
