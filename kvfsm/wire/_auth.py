"""A deployment's shared secret: HMAC-SHA256 tags over handshakes and notifications.

With a secret configured, every handshake request and reply and every notification carries a
tag only a holder of the secret can make, bound to what it must not be moved to: a notification's
sender and receiver agents and its place in the sender's stream (epoch, sequence number), a
handshake reply's request (its nonce). `ReplayGuard` refuses a notification seen before. It
authenticates; it does not encrypt (docs/security.md says what that leaves open).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from typing import NamedTuple

__all__ = [
    "MIN_SECRET_BYTES", "TAG_BYTES", "AuthError", "Opened", "ReplayGuard", "SharedSecret",
    "is_sealed",
]  # fmt: skip

MIN_SECRET_BYTES = 16
"""Shortest secret accepted: 128 bits, so that guessing it is not an attack."""
TAG_BYTES = 32  # HMAC-SHA256, untruncated
_SEALED = b"kvm2"  # a sealed notification: magic, epoch and sequence number, tag, plain message
_COUNTERS = struct.Struct("<QQ")
_HEAD = len(_SEALED) + _COUNTERS.size + TAG_BYTES
REPLAY_WINDOW = 64
"""Sequence numbers behind the highest seen that are still taken once (the fabric may reorder)."""
MAX_SENDERS = 4096
"""Senders a `ReplayGuard` remembers, least recently heard from first out."""


class AuthError(ValueError):
    """A tag is missing or wrong: the sender does not hold this deployment's secret, or the
    message was altered or moved."""


class SharedSecret:
    """The secret every engine of a deployment holds (`repr` never shows it)."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes | str) -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"a shared secret needs at least {MIN_SECRET_BYTES} bytes, got {len(key)}"
            )
        self._key = key

    def tag(self, label: bytes, *parts: bytes) -> bytes:
        """The tag of `parts` under `label` (the label keeps tags of one kind of message from
        being valid for another; each part is length-prefixed so parts cannot be re-cut)."""
        mac = hmac.new(self._key, label, hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def check(self, tag: bytes, label: bytes, *parts: bytes) -> None:
        """Raise `AuthError` unless `tag` is the tag of `parts` under `label`."""
        if not hmac.compare_digest(tag, self.tag(label, *parts)):
            raise AuthError("wrong tag: the sender does not hold this deployment's shared secret")

    def seal(
        self, sender: str, receiver: str, payload: bytes, epoch: int = 0, seq: int = 0
    ) -> bytes:
        """A notification from agent `sender` to agent `receiver`, number `seq` of the sender's
        incarnation `epoch` (later for a later incarnation), tagged."""
        counters = _COUNTERS.pack(epoch, seq)
        tag = self.tag(_LABEL, sender.encode(), receiver.encode(), counters, payload)
        return _SEALED + counters + tag + payload

    def open(self, sender: str, receiver: str, data: bytes) -> Opened:
        """The notification inside a sealed one from `sender` to `receiver`, with its epoch and
        sequence number; `AuthError` if it is not sealed or not by a holder of the secret for
        exactly these two agents and this place in the stream."""
        if not data.startswith(_SEALED) or len(data) < _HEAD:
            raise AuthError(f"unsealed notification from {sender!r}: this deployment needs a tag")
        counters = data[len(_SEALED) : len(_SEALED) + _COUNTERS.size]
        tag, payload = data[_HEAD - TAG_BYTES : _HEAD], data[_HEAD:]
        try:
            self.check(tag, _LABEL, sender.encode(), receiver.encode(), counters, payload)
        except AuthError:
            raise AuthError(f"notification from {sender!r} with a wrong tag") from None
        epoch, seq = _COUNTERS.unpack(counters)
        return Opened(epoch, seq, payload)

    def __repr__(self) -> str:
        return "SharedSecret(<hidden>)"


_LABEL = b"kvfsm/notification/2"


class Opened(NamedTuple):
    """A notification opened: the sender's epoch and sequence number, and the message."""

    epoch: int
    seq: int
    payload: bytes


class ReplayGuard:
    """Refuses a notification already taken: per sender, the latest epoch seen and a window of
    the last `REPLAY_WINDOW` sequence numbers. A later epoch (the sender restarted) starts a new
    window; an earlier one is refused, as is a number taken before or fallen behind the window.
    Remembers `MAX_SENDERS` senders (a forgotten one starts afresh). Check only what `open`
    authenticated, so a forger cannot move the window."""

    def __init__(self, limit: int = MAX_SENDERS) -> None:
        self._seen: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # epoch, top, bits
        self._limit = limit

    def check(self, sender: str, epoch: int, seq: int) -> str | None:
        """None if (`epoch`, `seq`) from `sender` is new (and now taken), else why not."""
        known = self._seen.get(sender)
        if known is None or epoch > known[0]:
            state = (epoch, seq, 1)
        elif epoch < known[0]:
            return f"from an earlier incarnation of {sender!r}"
        else:
            _, top, bits = known
            if seq > top:
                shift = seq - top
                state = (epoch, seq, ((bits << shift) | 1) & _WINDOW_MASK if shift < 64 else 1)
            elif top - seq >= REPLAY_WINDOW:
                return f"number {seq} from {sender!r} fell behind the window"
            elif bits >> (top - seq) & 1:
                return f"number {seq} from {sender!r} was taken before (a replay)"
            else:
                state = (epoch, top, bits | 1 << (top - seq))
        self._seen[sender] = state
        self._seen.move_to_end(sender)
        if len(self._seen) > self._limit:
            self._seen.popitem(last=False)
        return None


_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1


def is_sealed(data: bytes) -> bool:
    """Whether a notification is sealed (what a receiver without a secret can still tell)."""
    return data.startswith(_SEALED)
