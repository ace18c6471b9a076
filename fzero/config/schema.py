"""A small declarative schema for JSON configs: typed fields with defaults, sections, tagged unions.

A config is checked against a tree of *specs*. Every failure raises a `ConfigError` whose message starts with the
key's dotted path and says what was expected, e.g.

    zero_optimization.stage: expected an integer in [0, 3], got 4

- `ConfigError` (a `ValueError`) for a wrong value, `ConfigTypeError` (also a `TypeError`) for a wrong type,
  `UnsupportedConfigError` (also a `NotImplementedError`) for a known feature fzero does not implement: such a field
  accepts its disabled (default) value only, never silently anything else.
- Keys the schema does not know are collected (dotted paths) so the caller can warn about them; sections declared
  `open` accept any extra key (third-party blocks whose contents do not concern fzero).

Example:
    >>> spec = Section({"stage": Field(Int(0, 3), 0), "offload": Field(Bool(), False, unsupported="not here")})
    >>> spec.validate({"stage": 2, "colour": "red"}, "zero", unknown := [])
    {'stage': 2, 'offload': False}
    >>> unknown
    ['zero.colour']
    >>> spec.validate({"stage": "2"}, "zero", [])
    Traceback (most recent call last):
    ...
    fzero.config.schema.ConfigTypeError: zero.stage: expected an integer in [0, 3], got '2' (str)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REQUIRED",
    "Bool",
    "ConfigError",
    "ConfigTypeError",
    "ConfigWarning",
    "Field",
    "Int",
    "ListOf",
    "Nullable",
    "Num",
    "PerGroup",
    "Section",
    "Spec",
    "Str",
    "Tagged",
    "UnsupportedConfigError",
    "off",
]


class ConfigWarning(UserWarning):
    """Config keys fzero ignores: keys it does not know, and DeepSpeed blocks that DeepSpeed's engine does not
    train with either (e.g. `autotuning`, its launcher's)."""


class ConfigError(ValueError):
    """A config value is wrong. `key` is its dotted path (`""` for the whole config)."""

    def __init__(self, key: str, message: str, *, bare: bool = False) -> None:
        super().__init__(message if bare or not key else f"{key}: {message}")
        self.key = key


class ConfigTypeError(ConfigError, TypeError):
    """A config value has the wrong type."""


class UnsupportedConfigError(ConfigError, NotImplementedError):
    """A known DeepSpeed feature that fzero does not implement was enabled."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The default of a field that must be given."""


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    # JSON writes 5e8 as a float: DeepSpeed (pydantic) accepts integral floats for integer fields
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    )


class Spec:
    """A value's type and constraints: `validate(value, path, unknown) -> value` and `expect` (in words)."""

    @property
    def expect(self) -> str:
        return "a value"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        raise NotImplementedError

    def type_error(self, path: str, value: Any) -> ConfigTypeError:
        hint = ""
        if value == "auto":
            hint = " ('auto' is filled in by Hugging Face's Trainer; give the value itself)"
        return ConfigTypeError(path, f"expected {self.expect}, got {_show(value)}{hint}")

    def value_error(self, path: str, value: Any) -> ConfigError:
        return ConfigError(path, f"expected {self.expect}, got {_show(value)}")


@dataclass(frozen=True)
class Int(Spec):
    """An integer in `[low, high]` (an integral float such as `5e8` counts)."""

    low: int | None = None
    high: int | None = None

    @property
    def expect(self) -> str:
        if self.low is not None and self.high is not None:
            return f"an integer in [{self.low}, {self.high}]"
        if self.low is not None:
            return f"an integer >= {self.low}"
        if self.high is not None:
            return f"an integer <= {self.high}"
        return "an integer"

    def validate(self, value: Any, path: str, unknown: list[str]) -> int:
        if not _is_int(value):
            raise self.type_error(path, value)
        value = int(value)
        if not -(2**63) <= value < 2**63:
            raise ConfigError(path, f"expected {self.expect} that fits in 64 bits, got {value:.3g}")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise self.value_error(path, value)
        return value


@dataclass(frozen=True)
class Num(Spec):
    """A finite number in `[low, high]`; `low_open` / `high_open` exclude the bound."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @property
    def expect(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return "a finite number" + (" " + " and ".join(parts) if parts else "")

    def validate(self, value: Any, path: str, unknown: list[str]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.type_error(path, value)
        if not math.isfinite(value):
            raise self.value_error(path, value)
        low, high = self.low, self.high
        if low is not None and (value < low or (self.low_open and value == low)):
            raise self.value_error(path, value)
        if high is not None and (value > high or (self.high_open and value == high)):
            raise self.value_error(path, value)
        return value


@dataclass(frozen=True)
class Bool(Spec):
    """`true` or `false`."""

    expect = "true or false"

    def validate(self, value: Any, path: str, unknown: list[str]) -> bool:
        if not isinstance(value, bool):
            raise self.type_error(path, value)
        return value


@dataclass(frozen=True)
class Str(Spec):
    """A string, one of `choices` if given (compared case-insensitively with `fold`; the canonical spelling of the
    choice is returned)."""

    choices: tuple[str, ...] | None = None
    fold: bool = False

    @property
    def expect(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices) if self.choices else "a string"

    def validate(self, value: Any, path: str, unknown: list[str]) -> str:
        if not isinstance(value, str):
            raise self.type_error(path, value)
        if self.choices is None:
            return value
        for choice in self.choices:
            if value == choice or (self.fold and value.lower() == choice.lower()):
                return choice
        raise self.value_error(path, value)


@dataclass(frozen=True)
class Nullable(Spec):
    """`null` or a value of `inner`."""

    inner: Spec

    @property
    def expect(self) -> str:
        return f"null or {self.inner.expect}"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        return None if value is None else self.inner.validate(value, path, unknown)


@dataclass(frozen=True)
class Every(Nullable):
    """A period in steps: `inner`, or `null` or infinity for never (Accelerate writes `float("inf")`)."""

    @property
    def expect(self) -> str:
        return f"null, infinity (never) or {self.inner.expect}"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        if isinstance(value, float) and value == math.inf:
            return None
        return super().validate(value, path, unknown)


@dataclass(frozen=True)
class ListOf(Spec):
    """A list (JSON array) of `inner` values, of exactly `length` items if given."""

    inner: Spec
    length: int | None = None

    @property
    def expect(self) -> str:
        n = f"{self.length} " if self.length is not None else ""
        return f"a list of {n}values, each {self.inner.expect}"

    def validate(self, value: Any, path: str, unknown: list[str]) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise self.type_error(path, value)
        if self.length is not None and len(value) != self.length:
            raise ConfigError(path, f"expected {self.expect}, got {len(value)} values")
        return [self.inner.validate(v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]


@dataclass(frozen=True)
class PerGroup(Spec):
    """A value of `inner` for every param group, or a list of them, one per param group (DeepSpeed's schedulers
    take either; the list's length is checked against the groups when the schedule is built)."""

    inner: Spec

    @property
    def expect(self) -> str:
        return f"{self.inner.expect}, or a list of them (one per param group)"

    def validate(self, value: Any, path: str, unknown: list[str]) -> Any:
        if isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(path, f"expected {self.expect}, got an empty list")
            return [self.inner.validate(v, f"{path}[{i}]", unknown) for i, v in enumerate(value)]
        try:
            return self.inner.validate(value, path, unknown)
        except ConfigTypeError:
            raise self.type_error(path, value) from None


@dataclass(frozen=True)
class Field:
    """A key of a section.

    Attributes:
      spec: the value's type and constraints.
      default: used when the key is absent (`REQUIRED`: it must be given).
      unsupported: why fzero does not implement the feature; any value but the supported ones raises
        `UnsupportedConfigError` with this reason.
      supported: which values are supported when `unsupported` is set (default: the default value only).
      effect: what the key does in fzero, for the documentation ("" where it does what DeepSpeed's does).
    """

    spec: Spec
    default: Any = None
    unsupported: str | None = None
    supported: Callable[[Any], bool] | None = None
    effect: str = ""

    def check_supported(self, value: Any, path: str, given: Any = None) -> None:
        """Raise `UnsupportedConfigError` if the validated `value` is not a supported one, showing `given` (the value
        as written: an open section's validated value holds only the keys it declares) or else `value`."""
        if self.unsupported is None:
            return
        ok = self.supported(value) if self.supported is not None else value == self.default
        if not ok:
            shown = _show(value if given is None else given)
            raise UnsupportedConfigError(path, f"{shown} is not supported by fzero: {self.unsupported}")


Check = Callable[[dict[str, Any], str], None]


def off(reason: str) -> Field:
    """A DeepSpeed switch fzero does not implement: accepted only while false, else `reason` in the error."""
    return Field(Bool(), False, unsupported=reason)


@dataclass(frozen=True)
class Section(Spec):
    """A JSON object with declared keys.

    Attributes:
      fields: key -> `Field` (or a nested spec, whose default is its own defaults).
      aliases: alternative key -> canonical key (both given: an error).
      deprecated: old key -> its new name, read as the new one with a `DeprecationWarning` that names both (both
        given: an error).
      open: accept undeclared keys without reporting them.
      coerce: turn a non-object value into an object first (e.g. DeepSpeed's legacy `"zero_optimization": true`);
        return None to reject the value.
      checks: cross-field checks `check(values, path)`, run after every field is valid.
    """

    fields: Mapping[str, Field | Spec]
    aliases: Mapping[str, str] = field(default_factory=dict)
    deprecated: Mapping[str, str] = field(default_factory=dict)
    open: bool = False
    coerce: Callable[[Any], dict[str, Any] | None] | None = None
    checks: tuple[Check, ...] = ()

    expect = "an object (JSON {...})"

    def field(self, key: str) -> Field:
        f = self.fields[key]
        return f if isinstance(f, Field) else Field(f, None)

    def defaults(self) -> dict[str, Any]:
        """The section's values when it is absent or empty."""
        return self.validate({}, "", [])

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if not isinstance(value, Mapping) and self.coerce is not None:
            coerced = self.coerce(value)
            value = value if coerced is None else coerced
        if not isinstance(value, Mapping):
            raise self.type_error(path, value)
        raw = dict(value)
        for alias, canonical in {**self.aliases, **self.deprecated}.items():
            if alias in raw:
                if canonical in raw:
                    raise ConfigError(_join(path, alias), f"give either {alias!r} or {canonical!r}, not both")
                if alias in self.deprecated:
                    warnings.warn(f"{_join(path, alias)} is the old name of {_join(path, canonical)}, read as it",
                                  DeprecationWarning, stacklevel=4)  # fmt: skip
                raw[canonical] = raw.pop(alias)
        out: dict[str, Any] = {}
        for key, declared in self.fields.items():
            where = _join(path, key)
            f = declared if isinstance(declared, Field) else Field(declared, None)
            if key not in raw or (raw[key] is None and isinstance(f.spec, Section)):
                if f.default is REQUIRED:
                    raise ConfigError(where, f"is required: expected {f.spec.expect}")
                if isinstance(f.spec, Section):
                    out[key] = f.spec.validate({}, where, unknown)
                else:
                    out[key] = f.default
                continue
            checked = f.spec.validate(raw[key], where, unknown)
            f.check_supported(checked, where, given=raw[key])
            out[key] = checked
        for key in raw:
            if key not in self.fields and not self.open:
                if not isinstance(key, str):
                    raise ConfigTypeError(path, f"keys must be strings, got {_show(key)}")
                unknown.append(_join(path, key))
        for check in self.checks:
            check(out, path)
        return out

    def paths(self, prefix: str = "") -> list[tuple[str, Spec]]:
        """Every declared key's dotted path and spec, depth first (for documentation and fuzzing)."""
        out: list[tuple[str, Spec]] = []
        for key, declared in self.fields.items():
            spec = declared.spec if isinstance(declared, Field) else declared
            where = _join(prefix, key)
            out.append((where, spec))
            inner = spec.inner if isinstance(spec, Nullable) else spec
            if isinstance(inner, Section):
                out.extend(inner.paths(where))
        return out


@dataclass(frozen=True)
class Tagged(Spec):
    """An object whose `params` depend on its `type` (DeepSpeed's `optimizer` and `scheduler` blocks).

    Attributes:
      variants: type name -> the `Section` of its `params`.
      unsupported: type name -> why fzero does not implement it.
      fold: compare type names case-insensitively (DeepSpeed lower-cases optimizer names, not scheduler names).
      extra: other keys of the block besides `type` and `params`.
    """

    variants: Mapping[str, Section]
    unsupported: Mapping[str, str] = field(default_factory=dict)
    fold: bool = False
    extra: Mapping[str, Field] = field(default_factory=dict)

    expect = 'an object {"type": ..., "params": {...}}'

    def _lookup(self, name: str, table: Mapping[str, Any]) -> str | None:
        for key in table:
            if name == key or (self.fold and name.lower() == key.lower()):
                return key
        return None

    def validate(self, value: Any, path: str, unknown: list[str]) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise self.type_error(path, value)
        names = ", ".join(repr(k) for k in self.variants)
        where = _join(path, "type")
        if "type" not in value:
            raise ConfigError(where, f"is required: one of {names}")
        name = value["type"]
        if not isinstance(name, str):
            raise ConfigTypeError(where, f"expected one of {names}, got {_show(name)}")
        canonical = self._lookup(name, self.variants)
        if canonical is None:
            off = self._lookup(name, self.unsupported)
            if off is not None:
                raise UnsupportedConfigError(
                    where, f"{name!r} is not supported by fzero: {self.unsupported[off]}; supported: {names}"
                )
            raise ConfigError(where, f"expected one of {names}, got {_show(name)}")
        params = value.get("params")
        params = {} if params is None else params
        out = {"type": canonical, "params": self.variants[canonical].validate(params, _join(path, "params"), unknown)}
        for key, f in self.extra.items():
            out[key] = f.default if key not in value else f.spec.validate(value[key], _join(path, key), unknown)
            f.check_supported(out[key], _join(path, key))
        for key in value:
            if key not in ("type", "params") and key not in self.extra:
                unknown.append(_join(path, str(key)))
        return out


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
