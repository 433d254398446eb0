"""The framing the side channel's small exchanges share (status questions, operator requests):
a magic prefix, and with the deployment's shared secret a tag over the body and the nonce of the
request a reply answers."""

from __future__ import annotations

from typing import NamedTuple

from kvfsm.sidechannel._payload import SidechannelError, Unauthenticated
from kvfsm.wire import TAG_BYTES, AuthError, SharedSecret

__all__ = ["Framing"]


class Framing(NamedTuple):
    """One kind of frame: `magic` untagged, `sealed` tagged (magic, tag, body) in `domain`,
    at most `max_bytes`; `what` names it in errors."""

    magic: bytes
    sealed: bytes
    domain: bytes
    what: str
    max_bytes: int

    def owns(self, data: bytes) -> bool:
        """Whether `data` is a frame of this kind."""
        return data.startswith((self.magic, self.sealed))

    def seal(self, body: bytes, kind: bytes, nonce: bytes, secret: SharedSecret | None) -> bytes:
        """`body` as a frame; with `secret`, tagged over `kind` and `nonce`."""
        if secret is None:
            return self.magic + body
        return self.sealed + secret.tag(self.domain, kind, nonce, body) + body

    def open(self, data: bytes, kind: bytes, nonce: bytes, secret: SharedSecret | None) -> bytes:
        """The body of a frame; `SidechannelError` (`Unauthenticated` for a missing or wrong
        tag when there is a secret) says why it is refused."""
        if len(data) > self.max_bytes:
            raise SidechannelError(f"{self.what} {kind.decode()} of {len(data)} bytes")
        head = len(self.sealed)
        if data.startswith(self.sealed) and len(data) >= head + TAG_BYTES:
            tag, body = data[head : head + TAG_BYTES], data[head + TAG_BYTES :]
        elif data.startswith(self.magic):
            tag, body = None, data[len(self.magic) :]
        else:
            raise SidechannelError(f"not a kvfsm {self.what} frame (starts {data[:8]!r})")
        if secret is not None:
            if tag is None:
                raise Unauthenticated(f"untagged {self.what} {kind.decode()}: the secret is needed")
            try:
                secret.check(tag, self.domain, kind, nonce, body)
            except AuthError:
                raise Unauthenticated(f"{self.what} {kind.decode()} with a wrong tag") from None
        return body
