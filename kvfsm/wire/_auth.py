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
    "GAP_TTL_S",
    "MAX_GAPS",
    "MIN_SECRET_BYTES",
    "TAG_BYTES",
    "AuthError",
    "Opened",
    "ReplayGuard",
    "SharedSecret",
    "carried",
    "is_sealed",
]

MIN_SECRET_BYTES = 16
"""Shortest secret accepted: 128 bits, so that guessing it is not an attack."""
TAG_BYTES = 32  # HMAC-SHA256, untruncated
_SEALED = b"kvm2"  # a sealed notification: magic, epoch and sequence number, tag, plain message
_COUNTERS = struct.Struct("<QQ")
_HEAD = len(_SEALED) + _COUNTERS.size + TAG_BYTES
MAX_GAPS = 1 << 16
"""Numbers a `ReplayGuard` waits for at once, over all its senders (docs/security.md): a
number is waited for once a later one from the same sender was taken."""
GAP_TTL_S = 120.0
"""How long a `ReplayGuard` waits for a number by default (the engine passes its own bound)."""
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
    """Refuses a notification already taken, and takes every other one once.

    Per sender it keeps the latest epoch and the highest number taken in it (`top`); numbers
    below `top` not yet heard are *gaps*, waited for until taken, until `gap_ttl_s` after they
    opened, or until `max_gaps` newer gaps (over all senders) push them out. A number is taken
    only if it is above `top` or an open gap, so a replay is refused however late it comes; a
    legitimate notification is refused only if it trails a later one from its sender by more
    than the TTL or the gap bound. A later epoch (the sender restarted) starts at 0, an earlier
    one is refused. Remembers `limit` senders (a forgotten one starts afresh). Check only what
    `SharedSecret.open` authenticated, so a forger cannot open gaps."""

    def __init__(
        self, limit: int = MAX_SENDERS, max_gaps: int = MAX_GAPS, gap_ttl_s: float = GAP_TTL_S
    ) -> None:
        if limit < 1 or max_gaps < 1 or not gap_ttl_s > 0:
            raise ValueError("a ReplayGuard needs limit >= 1, max_gaps >= 1 and gap_ttl_s > 0")
        self._senders: OrderedDict[str, tuple[int, int]] = OrderedDict()  # epoch, top
        # (sender, epoch, number) -> when it stops being waited for; oldest first, since every
        # gap waits the same time and the clock only moves forward.
        self._gaps: OrderedDict[tuple[str, int, int], float] = OrderedDict()
        self._limit = limit
        self._max_gaps = max_gaps
        self._ttl = gap_ttl_s

    @property
    def gaps(self) -> int:
        """Numbers waited for now (memory: at most `max_gaps`)."""
        return len(self._gaps)

    @property
    def senders(self) -> int:
        """Senders remembered now (at most `limit`)."""
        return len(self._senders)

    def check(self, sender: str, epoch: int, seq: int, now: float = 0.0) -> str | None:
        """None if (`epoch`, `seq`) from `sender` is new (and now taken), else why not. `now`:
        the receiver's monotonic clock, in seconds."""
        self._expire(now)
        known = self._senders.get(sender)
        if known is None or epoch > known[0]:
            known = (epoch, 0)
        elif epoch < known[0]:
            return f"from an earlier incarnation of {sender!r}"
        top = known[1]
        if seq <= 0:
            return f"number {seq} from {sender!r} is never sent"
        if seq > top:
            self._open_gaps(sender, epoch, max(top + 1, seq - self._max_gaps), seq, now)
            top = seq
        elif self._gaps.pop((sender, epoch, seq), None) is None:
            return f"number {seq} from {sender!r} was taken before, or waited for too long"
        self._senders[sender] = (epoch, top)
        self._senders.move_to_end(sender)
        if len(self._senders) > self._limit:
            self._senders.popitem(last=False)
        return None

    def _open_gaps(self, sender: str, epoch: int, first: int, stop: int, now: float) -> None:
        until = now + self._ttl
        for number in range(first, stop):
            self._gaps[(sender, epoch, number)] = until
        for _ in range(len(self._gaps) - self._max_gaps):
            self._gaps.popitem(last=False)

    def _expire(self, now: float) -> None:
        gaps = self._gaps
        while gaps:
            key = next(iter(gaps))
            if gaps[key] > now:
                return
            del gaps[key]


def carried(data: bytes) -> bytes:
    """The message a notification carries: a sealed one's, unverified (for tools that sort
    traffic, e.g. to lose one kind on purpose; never to act on), else `data` itself."""
    return data[_HEAD:] if is_sealed(data) and len(data) >= _HEAD else data


def is_sealed(data: bytes) -> bool:
    """Whether a notification is sealed (what a receiver without a secret can still tell)."""
    return data.startswith(_SEALED)
