"""The ledger: what the collectives moved while it was recording (the ZeRO paper's accounting)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Ledger"]


@dataclass
class Ledger:
    """What the collectives moved while it was recording: `{collective: {calls, elements, sent, received}}`,
    element counts per rank."""

    world: int
    entries: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, kind: str, elements: int, moved: int, nbytes: int | None = None) -> None:
        entry = self.entries.get(kind)
        if entry is None:
            entry = self.entries[kind] = {"calls": 0, "elements": 0, "sent": 0, "received": 0}
            if nbytes is not None:
                entry["bytes"] = 0
        entry["calls"] += 1
        entry["elements"] += elements
        entry["sent"] += moved
        entry["received"] += moved
        if nbytes is not None:
            entry["bytes"] += nbytes

    def on(self, axis: str) -> dict[str, dict[str, int]]:
        """The collectives that ran over the named mesh axis `axis`: `{collective: counts}`."""
        suffix = f":{axis}"
        return {k.removesuffix(suffix): dict(v) for k, v in self.entries.items() if k.endswith(suffix)}

    def total(self, key: str = "elements") -> int:
        return sum(e[key] for e in self.entries.values())

    def crossing(self, shape: Mapping[str, int], inner: str) -> int:
        """Bytes one rank received from ranks outside its group along axis `inner` (of a mesh of this `shape` whose
        collectives recorded bytes: one with named axes): the slow links' share where a group is a node's ranks.

        Per collective over `n` ranks with payload `B` (the ledger's `bytes`), a rank receives `(n - 1) / n B`
        (twice for an all-reduce) from the others; of those, over every rank (`W`, `S` in the group), the
        `(W - S) / W B` from other groups; over another axis all of it (each peer is in another group); over
        `inner` none. (What a ring or tree sends over each link differs; the payload from outside does not.)
        """
        world, size = math.prod(shape.values()), shape[inner]
        out = 0
        for key, entry in self.entries.items():
            kind, _, axis = key.partition(":")
            if "bytes" not in entry or axis == inner:
                continue
            factor = 2 if kind == "all_reduce" else 1
            n = shape[axis] if axis else world
            outside = n - 1 if axis else world - size
            out += factor * entry["bytes"] * outside // n
        return out

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.entries.items()}
