"""`kv_transfer_params`: what P returns from `request_finished` and D reads back (vLLM's keys, so
vLLM's proxies pass them on unchanged). They come from a client, so D validates them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

__all__ = ["ParamsError", "RemotePrefill", "contact_of", "producer_params", "remote_prefill"]

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ParamsError(ValueError):
    """D's `kv_transfer_params` cannot name a P request; the message says what is wrong."""


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """What D needs from P's params: who P is, its id for the request and where to handshake.
    (P's block ids travel too, for vLLM's conventions; kvfsm's P matches by request id and
    never trusts block ids from D's side.)"""

    remote_engine_id: _Id
    remote_request_id: _Id
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    transfer_mode: str | None = None
    kvfsm_group_blocks: (
        Annotated[
            list[Annotated[int, msgspec.Meta(ge=0, le=1 << 24)]], msgspec.Meta(max_length=256)
        ]
        | None
    ) = None
    """With several KV cache groups: how many blocks of each group P moves."""

    @property
    def contact(self) -> str:
        """P's side channel, "host:port"."""
        return contact_of(self.remote_host, self.remote_port)


def contact_of(host: str, port: int) -> str:
    """A side channel's "host:port" (IPv6 hosts bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def remote_prefill(params: Mapping[str, Any], mode: str) -> RemotePrefill:
    """P's coordinates from D's request params; `ParamsError` if they are malformed or from a P
    running the other mode."""
    try:
        remote = msgspec.convert(dict(params), RemotePrefill, strict=True)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ParamsError(f"kv_transfer_params cannot name a P request: {exc}") from None
    if remote.transfer_mode is not None and remote.transfer_mode != mode:
        raise ParamsError(
            f"kv_transfer_params come from a P running {remote.transfer_mode!r}; this D runs"
            f" {mode!r}"
        )
    return remote


def producer_params(
    *,
    request_id: str,
    block_ids: list[int],
    engine_id: str,
    host: str,
    port: int,
    tp_size: int,
    num_tokens: int,
    mode: str,
    group_blocks: list[int] | None = None,
) -> dict[str, Any]:
    """The params P returns for a finished prefill (vLLM's keys, so its proxies pass them on;
    with several KV cache groups, `kvfsm_group_blocks` too)."""
    extra = {} if group_blocks is None else {"kvfsm_group_blocks": group_blocks}
    return extra | {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_num_tokens": num_tokens,
        "transfer_mode": mode,
    }
