"""A deployment's shared secret: HMAC-SHA256 tags over handshakes and notifications.

With a secret configured, every handshake request and acceptance and every notification carries a
tag only a holder of the secret can make, bound to what it must not be moved to: a notification's
sender and receiver agents, a handshake reply's request (its nonce). It authenticates; it does not
encrypt (docs/security.md says what that leaves open).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["MIN_SECRET_BYTES", "TAG_BYTES", "AuthError", "SharedSecret", "is_sealed"]

MIN_SECRET_BYTES = 16
"""Shortest secret accepted: 128 bits, so that guessing it is not an attack."""
TAG_BYTES = 32  # HMAC-SHA256, untruncated
_SEALED = b"kvm1"  # a sealed notification: magic, tag, then the plain notification


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

    def seal(self, sender: str, receiver: str, payload: bytes) -> bytes:
        """A notification from agent `sender` to agent `receiver`, tagged."""
        tag = self.tag(b"kvfsm/notification", sender.encode(), receiver.encode(), payload)
        return _SEALED + tag + payload

    def open(self, sender: str, receiver: str, data: bytes) -> bytes:
        """The notification inside a sealed one from `sender` to `receiver`; `AuthError` if it
        is not sealed or not by a holder of the secret for exactly these two agents."""
        if not data.startswith(_SEALED) or len(data) < len(_SEALED) + TAG_BYTES:
            raise AuthError(f"unsealed notification from {sender!r}: this deployment needs a tag")
        tag, payload = (
            data[len(_SEALED) : len(_SEALED) + TAG_BYTES],
            data[len(_SEALED) + TAG_BYTES :],
        )
        try:
            self.check(tag, b"kvfsm/notification", sender.encode(), receiver.encode(), payload)
        except AuthError:
            raise AuthError(f"notification from {sender!r} with a wrong tag") from None
        return payload

    def __repr__(self) -> str:
        return "SharedSecret(<hidden>)"


def is_sealed(data: bytes) -> bool:
    """Whether a notification is sealed (what a receiver without a secret can still tell)."""
    return data.startswith(_SEALED)
