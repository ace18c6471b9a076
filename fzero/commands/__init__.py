"""The `fzero` commands (see `fzero.cli`)."""
