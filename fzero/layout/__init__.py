"""The layout layer: how a model's parameters map into padded flat buffers, units and per-rank shards.

Pure and static: which parameters form a unit (`units`), names, shapes and dtypes to offsets (`flat`), a unit's
gradient arriving in pieces (`pieces`), and the blockwise int8 code the quantized collectives send (`int8`). It knows
no tensor's values beyond what it is handed, no rank and no collective.

May import: nothing of fzero.
"""

from .flat import (
    Layout,
    Leaf,
    TensorSpec,
    Unit,
    dtype_of,
    flatten,
    from_module,
    make_layout,
    shard,
    to_rank_major,
    to_unit_major,
    unflatten,
    unit_pieces,
    unit_views,
    unshard,
)
from .units import ROOT_UNIT, Auto, BySize, module_list_units, size_units, unit_policy

__all__ = [
    "ROOT_UNIT",
    "Auto",
    "BySize",
    "Layout",
    "Leaf",
    "TensorSpec",
    "Unit",
    "dtype_of",
    "flatten",
    "from_module",
    "make_layout",
    "module_list_units",
    "shard",
    "size_units",
    "to_rank_major",
    "to_unit_major",
    "unflatten",
    "unit_pieces",
    "unit_policy",
    "unit_views",
    "unshard",
]
