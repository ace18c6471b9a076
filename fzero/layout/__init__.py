"""The layout layer: how a model's parameters map into padded flat buffers, units and per-rank shards.

Pure and static: names, shapes and dtypes to offsets (`flat`), a unit's gradient arriving in pieces (`pieces`), and
the blockwise int8 code the quantized collectives send (`int8`). It knows no tensor's values beyond what it is handed,
no rank and no collective.

May import: nothing of fzero.
"""

from .flat import (
    ROOT_UNIT,
    BySize,
    Layout,
    Leaf,
    TensorSpec,
    Unit,
    dtype_of,
    flatten,
    from_module,
    make_layout,
    module_list_units,
    shard,
    size_units,
    to_rank_major,
    to_unit_major,
    unflatten,
    unit_pieces,
    unit_views,
    unshard,
)

__all__ = [
    "ROOT_UNIT",
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
    "unit_views",
    "unshard",
]
