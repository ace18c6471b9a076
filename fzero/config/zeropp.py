"""DeepSpeed's ZeRO++ (`zero_hpz_partition_size`, `zero_quantized_weights`, `zero_quantized_nontrainable_weights`,
`zero_quantized_gradients`) and MiCS (`mics_shard_size`, `mics_hierarchical_params_gather`) keys: their checks (at
parse time: `zeropp_checks`, `zeropp_top_checks`), the 2-D mesh they ask for (`zero_mesh_shape`, which needs the
world size, and for qgZ the launcher's node layout: `qgz_nodes`) and the `fzero.zero3` arguments they map to
(`zeropp_arguments`). docs/hybrid.md, "From a DeepSpeed config" and "Several nodes", has the table and DeepSpeed's
sources.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..host import process_group
from .schema import ConfigError, ConfigWarning

__all__ = ["qgz_nodes", "zero_mesh_key", "zero_mesh_shape", "zeropp_arguments", "zeropp_checks", "zeropp_top_checks"]


def zeropp_checks(values: dict[str, Any], path: str) -> None:
    """ZeRO++ (hpZ, qwZ, qgZ) and MiCS: the stages and combinations DeepSpeed applies them at (the rules that
    depend on the world size are `zero_mesh_shape`'s).

    DeepSpeed hands these keys to its stage-3 optimizer only (0.19.8 `runtime/engine.py` `_configure_zero_optimizer`,
    MiCS in 0.19.6's): at stages 0-2 they are no-ops there, so here too, with a `ConfigWarning`. With MiCS,
    DeepSpeed's optimizer gets neither qgZ's all-to-all groups nor hpZ's size, and its gather drops the
    quantization (0.19.6 `runtime/zero/mics.py`).
    """
    hpz, mics = values["zero_hpz_partition_size"] > 1, values["mics_shard_size"] > 0
    on = {
        "zero_hpz_partition_size": hpz,
        "zero_quantized_weights": values["zero_quantized_weights"],
        "zero_quantized_nontrainable_weights": values["zero_quantized_nontrainable_weights"],
        "zero_quantized_gradients": values["zero_quantized_gradients"],
        "mics_shard_size": mics,
        "mics_hierarchical_params_gather": values["mics_hierarchical_params_gather"],
    }
    if values["stage"] < 3:
        _ignored([k for k, v in on.items() if v], path, f"at stage {values['stage']}: DeepSpeed applies ZeRO++ and "
                 "MiCS at stage 3 only")  # fmt: skip
        return
    if on["mics_hierarchical_params_gather"] and not mics:
        _ignored(["mics_hierarchical_params_gather"], path, "without mics_shard_size > 0 (MiCS)")
    if not mics:
        if on["zero_quantized_gradients"] and not values["reduce_scatter"]:
            raise ConfigError(f"{path}.zero_quantized_gradients",
                              "needs reduce_scatter true at stage 3 (DeepSpeed's rule: its all-to-all reduce "
                              "replaces the reduce-scatter)")  # fmt: skip
        return
    if hpz:
        raise ConfigError(f"{path}.zero_hpz_partition_size",
                          f"{values['zero_hpz_partition_size']} with mics_shard_size {values['mics_shard_size']}: "
                          "give one of them (hpZ keeps the layout over every rank and a secondary copy per group, "
                          "MiCS shards within a group; DeepSpeed has no combined mode)")  # fmt: skip
    if on["zero_quantized_nontrainable_weights"]:
        raise ConfigError(f"{path}.zero_quantized_nontrainable_weights",
                          "is not supported with mics_shard_size > 0: DeepSpeed stores the frozen shards as int8, "
                          "and its MiCS gather all-gathers the shards as stored, without dequantizing")  # fmt: skip
    _ignored([k for k in ("zero_quantized_weights", "zero_quantized_gradients") if on[k]], path,
             "with mics_shard_size > 0: DeepSpeed's MiCS optimizer gathers and reduces unquantized")  # fmt: skip


def _ignored(keys: list[str], path: str, why: str) -> None:
    """One `ConfigWarning` naming `keys` (none: nothing) and why DeepSpeed, and so fzero, ignores them."""
    if keys:
        names = ", ".join(f"{path}.{k}" for k in keys)
        warnings.warn(f"{names} {'is' if len(keys) == 1 else 'are'} ignored {why}", ConfigWarning, stacklevel=2)


def zeropp_top_checks(values: dict[str, Any]) -> None:
    """qgZ takes no prescale or predivide (the rule that reads the config's top level)."""
    zero = values["zero_optimization"]
    qgz = zero["stage"] == 3 and zero["zero_quantized_gradients"] and zero["mics_shard_size"] <= 0
    if qgz and (values["prescale_gradients"] or values["gradient_predivide_factor"] != 1.0):
        raise ConfigError(
            "zero_optimization.zero_quantized_gradients",
            "takes no prescale_gradients or gradient_predivide_factor: qgZ quantizes with its own scales and "
            "divides after the sum (and DeepSpeed's stage 3 refuses a predivide factor with reduce_scatter)",
        )


def qgz_nodes(cfg: Any) -> tuple[int, int] | None:
    """`(nodes, ranks per node)` where the config's qgZ acts: stage 3, `zero_quantized_gradients`, no MiCS, and the
    launcher's node layout (`fzero.host.process_group.node_layout`) has several nodes; else None.

    DeepSpeed's stage 3 quantizes only then (0.19.8 `runtime/zero/stage3.py` `__avg_scatter_grads`: `num_nodes =
    world // device_count()`, the all-to-all only where `num_nodes > 1`, else the plain reduce-scatter), and then
    hierarchically over its node groups (`utils/groups.py` `_get_local_all_to_all_group`: `local_i` the ranks of
    node i, `global_j` the j-th rank of every node).

    Raises:
      ConfigError: the launcher's node layout does not fit `cfg.world`, naming the variable.
    """
    zero = cfg["zero_optimization"]
    if cfg.stage != 3 or not zero["zero_quantized_gradients"] or zero["mics_shard_size"] > 0:
        return None
    try:
        nodes, local = process_group.node_layout(cfg.world)
    except ValueError as e:
        raise ConfigError("zero_optimization.zero_quantized_gradients", f"needs the node layout: {e}") from None
    return (nodes, local) if nodes > 1 else None


def zero_mesh_shape(cfg: Any) -> dict[str, int] | None:
    """The mesh the config's hpZ, MiCS or qgZ asks for on `cfg.world` ranks: `{"replicate": W // n, "shard": n}` (the
    `shard` axis innermost: groups of `n` consecutive ranks, as DeepSpeed's), or None for the 1-D mesh.

    At stage 3 only (DeepSpeed ignores the keys below it). `mics_shard_size: S` > 0: `n = S`, which must divide
    W (0.19.6 `runtime/zero/mics_utils.py` `_generate_mics_config`); `S == W` is the 1-D mesh (one shard group:
    DeepSpeed's replicate all-reduce is over one rank and skipped); `S < W` takes no optimizer offload (0.19.6
    `runtime/zero/mics.py` `allreduce_mics_shard_grads` raises for gradient shards off the accelerator).
    `zero_hpz_partition_size: N` > 1: `n = min(N, W)`, which must divide W (0.19.8 `utils/groups.py`
    `_create_zero_param_parallel_group`); `n == W` is the 1-D mesh (the secondary copy is then the primary shard:
    plain stage 3), as is any N at world 1. Neither group defaults to the node: DeepSpeed's defaults are
    `mics_shard_size: -1` and `zero_hpz_partition_size: 1`, off (0.19.8 `runtime/zero/config.py`; MiCS reads the
    node only for `mics_hierarchical_params_gather`'s schedule). qgZ on several nodes (`qgz_nodes`): `n` = the
    ranks per node (an hpZ group must then be the node).

    Args:
      cfg: the validated config; `cfg.world` is the data-parallel world size.

    Returns:
      The mesh shape, or None.

    Raises:
      ConfigError: the group size does not divide the world size, or hpZ's group is not the node with qgZ on
        several nodes, naming the key.
    """
    group = _group(cfg)
    return None if group is None else {"replicate": cfg.world // group[1], "shard": group[1]}


def zero_mesh_key(cfg: Any) -> str | None:
    """The `zero_optimization` key that makes `zero_mesh_shape(cfg)` 2-D (`mics_shard_size`,
    `zero_hpz_partition_size` or `zero_quantized_gradients`), or None."""
    group = _group(cfg)
    return None if group is None else group[0]


def _group(cfg: Any) -> tuple[str, int] | None:
    """`(key, n)`: the key that asks for groups of `n` < W consecutive ranks (see `zero_mesh_shape`), or None."""
    zero, world = cfg["zero_optimization"], cfg.world
    if cfg.stage != 3:
        return None
    nodes = qgz_nodes(cfg)
    hpz = min(zero["zero_hpz_partition_size"], world)
    if zero["mics_shard_size"] > 0:
        key, n = "mics_shard_size", zero["mics_shard_size"]
        if world % n:
            raise ConfigError(f"zero_optimization.{key}",
                              f"{n} does not divide the world size {world}: MiCS shards over groups of {n} "
                              "consecutive ranks (DeepSpeed's rule)")  # fmt: skip
        if n < world and zero["offload_optimizer"]["device"] != "none":
            raise ConfigError(f"zero_optimization.{key}",
                              f"{n} < the world size {world} with offload_optimizer: DeepSpeed's MiCS all-reduces "
                              "the gradient shards across its groups on the accelerator only (\"Local sharding has "
                              "no support for CPU offloading\")")  # fmt: skip
    elif 1 < hpz < world:
        key, n = "zero_hpz_partition_size", hpz
        if world % n:
            raise ConfigError(f"zero_optimization.{key}",
                              f"{n} does not divide the world size {world}: hpZ's secondary partition is over "
                              f"groups of {n} consecutive ranks (DeepSpeed's rule)")  # fmt: skip
        if nodes is not None and n != nodes[1]:
            raise ConfigError(f"zero_optimization.{key}",
                              f"{n} with zero_quantized_gradients on {nodes[0]} nodes of {nodes[1]} ranks: fzero's "
                              "hierarchical qgZ reduces over hpZ's groups, which must then be the nodes "
                              f"(zero_hpz_partition_size {nodes[1]}, the ZeRO++ tutorial's setting)")  # fmt: skip
    elif nodes is not None:
        key, n = "zero_quantized_gradients", nodes[1]
    else:
        return None
    return None if n == world else (key, n)


def zeropp_arguments(cfg: Any) -> dict[str, Any]:
    """The `fzero.zero3` keywords of the config's ZeRO++ and MiCS keys, only those that act (`{}` below stage 3,
    where DeepSpeed ignores them): `hpz=True` or `hybrid=True` where hpZ or MiCS makes `zero_mesh_shape` 2-D (the
    transform must then run on a mesh of that shape), `qwz` and `qwz_frozen` for `zero_quantized_weights`
    (DeepSpeed's qwZ quantizes the gathers of frozen parameters too), `qwz_frozen` for
    `zero_quantized_nontrainable_weights`, `qgz=("replicate", "shard")` for `zero_quantized_gradients` on several
    nodes (`qgz_nodes`: fp32 within a node, int8 across nodes, on the node mesh); none on one node, where
    DeepSpeed's qgZ does nothing, nor with MiCS, whose optimizer quantizes nothing.
    `mics_hierarchical_params_gather` changes only how DeepSpeed schedules MiCS's all-gather (inter-node, then
    intra-node), not the gathered values: it has no counterpart.

    Raises:
      ConfigError: as `zero_mesh_shape`.
    """
    if cfg.stage != 3:
        return {}
    zero = cfg["zero_optimization"]
    mics = zero["mics_shard_size"] > 0
    out: dict[str, Any] = {}
    key = zero_mesh_key(cfg)
    if key in ("mics_shard_size", "zero_hpz_partition_size"):  # (qgZ's node mesh alone takes neither)
        out["hybrid" if mics else "hpz"] = True
    if not mics:
        # DeepSpeed's qwZ quantizes every gather (0.19.8 `partitioned_param_coordinator.py` `__all_gather_params`:
        # all parameters not stored int8, frozen ones included); `zero_quantized_nontrainable_weights` the frozen ones
        if zero["zero_quantized_weights"]:
            out.update(qwz=True, qwz_frozen=True)
        if zero["zero_quantized_nontrainable_weights"]:
            out["qwz_frozen"] = True
        if qgz_nodes(cfg) is not None:
            out["qgz"] = ("replicate", "shard")
    return out
