"""The errors a checkpoint raises: each names the file (or leaf) at fault and what was expected."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
]


class CheckpointError(Exception):
    """Base class: a checkpoint could not be saved, read or applied."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for (no directory, no `latest` pointer, no manifest)."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, truncated, altered, or not what the manifest says it is."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit the state it is loaded into (another model, another structure)."""


class CheckpointVersionError(IncompatibleCheckpointError):
    """The checkpoint was written in a newer format than this fzero reads."""


class CheckpointWarning(UserWarning):
    """A checkpoint loads, with a caveat (e.g. an old format whose manifest has no digest)."""
