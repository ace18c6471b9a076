"""docs/integrations.md's examples run as they are: each ```python block is a whole script, run one after the other
in one new process (`runpy`), the frameworks' process-wide state reset between them as a new process would have it
(Accelerate's singleton; the objects of the previous script collected, so its alias and environment are released)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).parent.parent / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
MARKS = ("Engine ", "tensors", "tensors")  # what each example prints last

RUN_ALL = """
import gc, runpy, sys
from accelerate.state import AcceleratorState
for path in sys.argv[1:]:
    runpy.run_path(path, run_name="__main__")
    print("--- done", path, flush=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
"""


def test_the_page_has_one_example_per_framework():
    assert [("FzeroTrainer" in b, "accelerate" in b, "FzeroStrategy" in b) for b in BLOCKS] == [
        (True, False, False), (False, True, False), (False, False, True),
    ]  # fmt: skip


@pytest.mark.timeout(300)
def test_the_examples_run(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    scripts = []
    for i, block in enumerate(BLOCKS):
        scripts.append(tmp_path / f"example{i}.py")
        scripts[-1].write_text(block.replace("/tmp/", f"{tmp_path}/"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_ALL, *map(str, scripts)], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = done.stdout.split("--- done")
    assert len(outputs) == len(BLOCKS) + 1, done.stdout
    for mark, output in zip(MARKS, outputs, strict=False):
        assert mark in output, output
