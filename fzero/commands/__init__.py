"""The `fzero` commands (see `fzero.cli`).

May import: every package (they are the command line's top).
"""
