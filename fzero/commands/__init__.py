"""The `fzero` commands (see `fzero.cli`).

May import: every package (they are the command line's top).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_import(command: str, source: str, config: str | None, convert: Callable[[dict[str, Any] | None], Path]) -> int:
    """An `import-*` command's run: read the `--config` JSON file (if given), convert, and report the result (an
    error as one line on stderr, exit 1).

    Args:
      command: the command's name, for the messages.
      source: what is imported (its path), for the report.
      config: the `--config` file's path, or None.
      convert: the conversion, given the config's contents (or None); returns the checkpoint written.

    Returns:
      The exit status.
    """
    from ..checkpoint import CheckpointError
    from ..config import ConfigError

    start = time.perf_counter()
    try:
        values = None
        if config is not None:
            with open(config) as f:
                values = json.load(f)
        path = convert(values)
    except (CheckpointError, ConfigError, OSError, json.JSONDecodeError) as e:
        print(f"fzero {command}: error: {e}", file=sys.stderr)
        return 1
    print(f"{path}: imported from {source} in {time.perf_counter() - start:.2f}s")
    return 0
