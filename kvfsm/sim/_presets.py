"""Small geometries and short bounds, so a simulated run reaches every path in a few steps."""

from __future__ import annotations

from kvfsm.core import CoreConfig
from kvfsm.layout import KvGeometry

__all__ = ["FAST_CONFIG", "SMALL_GEOMETRY", "SMALL_MLA_GEOMETRY"]

SMALL_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=4, head_dim=4, dtype_bytes=2, block_size=4, num_blocks=64
)
"""A small model: every TP size up to 4 splits its heads, and a block is 512 bytes on TP 1."""
SMALL_MLA_GEOMETRY = KvGeometry(
    num_layers=2, num_kv_heads=1, head_dim=16, dtype_bytes=2, block_size=4, num_blocks=64, mla=True
)
"""A small model with MLA: one latent KV replicated on every TP rank, 256 bytes per block."""

FAST_CONFIG = CoreConfig(
    lease_s=2.0,
    watchdog_s=2.0,
    stall_s=1.0,
    producer_stall_s=2.0,
    fence_s=3.0,
    heartbeat_s=0.5,
    pending_registration_ttl_s=2.0,
    peer_idle_ttl_s=3.0,
    status_query_s=0.5,
)
"""Short bounds so a simulated run reaches every deadline in a few simulated seconds."""
