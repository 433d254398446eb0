"""KV layouts and descriptor math.

* `KvGeometry`, `RegionLayout`, `BlockSlice`, `slice_ids`: per-layer regions (joint or split K/V,
  MLA), descriptor rows and row ids by broadcasting.
* `plan_pairings` and friends: heterogeneous TP, which remote ranks and which head slices.
* `block_size_factors`, `logical_to_kernel`, `pair_units`, `align_tail`: different block sizes on
  the two sides, and a D prefix-cache hit.
* `coalesce`: fewer, larger descriptors where both sides are contiguous.
* `MODELS`, `model_geometry`: real models' KV geometries, for the demo and the benchmarks.
"""

from kvfsm.layout._blocksize import (
    align_tail,
    block_size_factors,
    logical_to_kernel,
    pair_units,
)
from kvfsm.layout._coalesce import Coalesced, coalesce
from kvfsm.layout._geometry import KvGeometry
from kvfsm.layout._ids import Int64Array, id_bounds
from kvfsm.layout._models import DTYPES, MAX_BLOCKS, MIN_BLOCKS, MODELS, model_geometry
from kvfsm.layout._regions import BlockSlice, RegionLayout, SliceRows, slice_ids, slice_rows
from kvfsm.layout._tp import (
    RankPairing,
    TpPlan,
    check_compatible,
    local_descriptors,
    partner_ranks,
    plan_pairings,
    remote_descriptors,
)

__all__ = [
    "DTYPES",
    "MAX_BLOCKS",
    "MIN_BLOCKS",
    "MODELS",
    "BlockSlice",
    "Coalesced",
    "Int64Array",
    "KvGeometry",
    "RankPairing",
    "RegionLayout",
    "SliceRows",
    "TpPlan",
    "align_tail",
    "block_size_factors",
    "check_compatible",
    "coalesce",
    "id_bounds",
    "local_descriptors",
    "logical_to_kernel",
    "model_geometry",
    "pair_units",
    "partner_ranks",
    "plan_pairings",
    "remote_descriptors",
    "slice_ids",
    "slice_rows",
]
