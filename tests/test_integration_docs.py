"""docs/integrations.md's examples run as they are: each ```python block is a whole script, run in a process of its
own (the frameworks keep process-wide state: Accelerate's singleton, its environment variables)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).parent.parent / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_one_example_per_framework():
    assert [("FzeroTrainer" in b, "accelerate" in b, "FzeroStrategy" in b) for b in BLOCKS] == [
        (True, False, False), (False, True, False), (False, False, True),
    ]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["trainer", "accelerate", "lightning"])
def test_example_runs(index, tmp_path):
    pytest.importorskip("lightning" if index == 2 else "accelerate")
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index].replace("/tmp/", f"{tmp_path}/"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert ("Engine " if index == 0 else " tensors") in done.stdout, done.stdout  # what the example prints last
