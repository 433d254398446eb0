"""Two agents on one simulated network, for the SimFabric tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvfsm.fabric import DescArray, SimFabric, SimFaults, SimNetwork, XferHandle, XferOp

__all__ = ["LAT", "Buf", "Pair", "assert_balanced", "descs", "idx", "make_pair"]

Buf = npt.NDArray[np.uint8]
LAT = SimFaults().notif_latency


def descs(buf: Buf, blocks: Sequence[tuple[int, int]], dev: int = 0) -> DescArray:
    """Descriptor rows for (offset, length) blocks of `buf`."""
    base = buf.ctypes.data
    return np.array([(base + off, n, dev) for off, n in blocks], dtype=np.int64).reshape(-1, 3)


def idx(*rows: int) -> npt.NDArray[np.int64]:
    return np.array(rows, dtype=np.int64)


@dataclass
class Pair:
    net: SimNetwork
    a: SimFabric
    b: SimFabric
    abuf: Buf
    bbuf: Buf

    def xfer(
        self,
        op: XferOp = "WRITE",
        blocks: Sequence[tuple[int, int]] = ((0, 16),),
        rblocks: Sequence[tuple[int, int]] | None = None,
        notif: bytes = b"done",
    ) -> XferHandle:
        """A transfer by `a` pairing row i of `blocks` (in abuf) with row i of `rblocks` (bbuf)."""
        ld = self.a.prep_xfer_dlist(None, descs(self.abuf, blocks))
        rd = self.a.prep_xfer_dlist("b", descs(self.bbuf, rblocks or blocks))
        rows = np.arange(len(blocks), dtype=np.int64)
        return self.a.make_prepped_xfer(op, ld, rows, rd, rows, notif)


def make_pair(seed: int = 0, size: int = 64, **faults: Any) -> Pair:
    net = SimNetwork(seed, SimFaults(**faults))
    a, b = net.agent("a"), net.agent("b")
    abuf = np.arange(1, size + 1, dtype=np.uint8)
    bbuf = np.zeros(size, dtype=np.uint8)
    a.register_memory(abuf)
    b.register_memory(bbuf)
    assert a.add_remote_agent(b.get_agent_metadata()) == "b"
    assert b.add_remote_agent(a.get_agent_metadata()) == "a"
    return Pair(net, a, b, abuf, bbuf)


def assert_balanced(net: SimNetwork) -> None:
    s = net.stats
    assert s.notifs_sent + s.notifs_duplicated == (
        s.notifs_delivered + s.notifs_dropped + net.pending_notifs()
    )
