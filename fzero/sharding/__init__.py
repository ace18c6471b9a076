"""The sharding layer: a model's parameters cut into units and shards, built sharded, gathered unit by unit.

One unit's state and verbs (`gathered_unit`), the schedule of unit-at-a-time gathering in the forward and backward
(`units`), sharded construction from `meta` and the copy of a model built in memory (`construct`), and the step's
tensors bound into the module through forward and backward (`bind`).

May import: `fzero.host`, `fzero.storage`, `fzero.layout`, `fzero.mesh`.
"""
