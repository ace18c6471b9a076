"""DeepSpeed's batch triad: `train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * W`.

Derivation (DeepSpeed 0.19, `runtime/config.py`), with `W` the data-parallel world size and `//` floor division:

| given | derived |
|---|---|
| all three | nothing |
| `tbs`, `mb` | `gas = tbs // mb // W` |
| `tbs`, `gas` | `mb = tbs // W // gas` |
| `mb`, `gas` | `tbs = mb * gas * W` |
| `tbs` | `gas = 1`, `mb = tbs // W` |
| `mb` | `gas = 1`, `tbs = mb * W` |

then every value must be positive and the product must hold; the floor divisions make sizes that do not divide fail
that last check. The error messages are DeepSpeed's, word for word.

Example:
    >>> resolve_batch(32, None, 4, world=2)
    (32, 4, 4)
    >>> resolve_batch(32, 5, None, world=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fzero.config.batch.BatchSizeError: Check batch related parameters. ... world_size 32 != 5 * 3 * 2
"""

from __future__ import annotations

from .schema import ConfigError

__all__ = ["BatchSizeError", "resolve_batch"]


class BatchSizeError(ConfigError):
    """The batch triad is missing, non-positive or inconsistent (DeepSpeed's messages)."""


def resolve_batch(
    train_batch_size: int | None, micro_batch: int | None, grad_acc: int | None, world: int
) -> tuple[int, int, int]:
    """`(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)` for `world` ranks.

    Args:
      train_batch_size, micro_batch, grad_acc: the config's values (None where absent).
      world: the data-parallel world size.

    Raises:
      BatchSizeError: with DeepSpeed's message, `key` naming the first offending key.
    """
    tbs, mb, gas = train_batch_size, micro_batch, grad_acc
    if tbs is None and mb is None:
        raise BatchSizeError(
            "train_batch_size",
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            bare=True,
        )
    if tbs is not None and mb is not None and gas is not None:
        pass
    elif tbs is not None and mb is not None:
        if mb == 0:  # DeepSpeed divides by zero here; name the key instead
            _check_positive(tbs, mb, None)
        gas = tbs // mb // world
    elif tbs is not None and gas is not None:
        if gas == 0:
            _check_positive(tbs, None, gas)
        mb = tbs // world // gas
    elif mb is not None and gas is not None:
        tbs = mb * gas * world
    elif tbs is not None:
        gas, mb = 1, tbs // world
    else:
        assert mb is not None  # (the first check)
        tbs, gas = mb * world, 1
    assert tbs is not None and mb is not None and gas is not None  # each branch above sets all three
    _check_positive(tbs, mb, gas)
    if tbs != mb * gas * world:
        raise BatchSizeError(
            "train_batch_size",
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step "
            f"* world_size {tbs} != {mb} * {gas} * {world}",
            bare=True,
        )
    return tbs, mb, gas


def _check_positive(tbs: int | None, mb: int | None, gas: int | None) -> None:
    if tbs is not None and tbs <= 0:
        raise BatchSizeError("train_batch_size", f"Train batch size: {tbs} has to be greater than 0", bare=True)
    if mb is not None and mb <= 0:
        raise BatchSizeError(
            "train_micro_batch_size_per_gpu", f"Micro batch size per gpu: {mb} has to be greater than 0", bare=True
        )
    if gas is not None and gas <= 0:
        raise BatchSizeError(
            "gradient_accumulation_steps", f"Gradient accumulation steps: {gas} has to be greater than 0", bare=True
        )
