"""What the side channel's tests share: a geometry, its compatibility hash, two prefill ranks'
payloads and the bound every wait keeps."""

from __future__ import annotations

import msgspec

from kvfsm.layout import KvGeometry
from kvfsm.sidechannel import (
    HandshakePayload,
    compat_hash,
)

HOST = "127.0.0.1"
WIRE = 1
GEOMETRY = KvGeometry(
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    block_size=16,
    num_blocks=1024,
    tp_size=2,
)
HASH = compat_hash(
    wire_version=WIRE, mode="push", model="llama-3-8b", dtype="bfloat16", geometry=GEOMETRY
)
SAFETY_S = 10.0  # bounds every wait in this file; never reached when things work


def payload(engine_id: str = "prefill", rank: int = 0, **changes: object) -> HandshakePayload:
    g = GEOMETRY.for_rank(rank)
    base = HandshakePayload(
        engine_id=engine_id,
        agent=f"{engine_id}#{rank}",
        agent_metadata=b"nixl-metadata-" + engine_id.encode(),
        geometry=g,
        base_addresses=tuple(0x7F0000000000 + (rank * 64 + i) * g.region_bytes for i in range(32)),
        block_lens=(g.block_len,) * 32,
        mode="push",
        wire_version=WIRE,
        compat_hash=HASH,
        incarnation=1_700_000_000_000_000_000 + rank,  # the process, as `new_epoch` names it
    )
    return msgspec.structs.replace(base, **changes)


PAYLOADS = {p.agent: p for p in (payload(rank=0), payload(rank=1))}
