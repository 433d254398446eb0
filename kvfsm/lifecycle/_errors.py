"""Protocol errors: an event a state does not accept, naming whose fault it is (after h11)."""

from __future__ import annotations

from kvfsm.lifecycle._model import Origin

__all__ = [
    "InternalProtocolError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "protocol_error",
]


class ProtocolError(Exception):
    """An event arrived in a state that does not accept it."""

    fault = "unknown"

    def __init__(self, request: str, side: str, lifecycle: str, state: str, event: str) -> None:
        self.request = request
        self.side = side
        self.lifecycle = lifecycle
        self.state = state
        self.event = event
        super().__init__(
            f"request {request!r} on {side} ({lifecycle}): event {event!r} is not accepted in "
            f"state {state!r}; this is the {self.fault}'s fault"
        )


class LocalProtocolError(ProtocolError):
    """The caller driving kvfsm (the serving engine) sent an event out of order."""

    fault = "caller"


class RemoteProtocolError(ProtocolError):
    """The peer engine sent a message this request cannot take now."""

    fault = "peer"


class InternalProtocolError(ProtocolError):
    """kvfsm itself (its timers, fabric handling or core) produced an event out of order: a bug."""

    fault = "kvfsm"


_BY_ORIGIN: dict[Origin, type[ProtocolError]] = {
    Origin.CALLER: LocalProtocolError,
    Origin.PEER: RemoteProtocolError,
    Origin.FABRIC: InternalProtocolError,
    Origin.TIMER: InternalProtocolError,
    Origin.KVFSM: InternalProtocolError,
}


def protocol_error(
    origin: Origin, request: str, side: str, lifecycle: str, state: str, event: str
) -> ProtocolError:
    """The protocol error for an illegal event of the given origin."""
    return _BY_ORIGIN[origin](request, side, lifecycle, state, event)
