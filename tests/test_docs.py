"""The documentation's code runs: every ```python block of the pages below, in order, in one namespace per page."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
PAGES = ["deepspeed.md", "offload.md", "transformers.md", "transforms.md"]


def blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page, tmp_path, monkeypatch):
    if page == "transformers.md":
        pytest.importorskip("transformers")
        pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    code = blocks(page)
    assert code, f"{page} has no python blocks"
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, source in enumerate(code):
            exec(compile(source.replace("/tmp/", f"{tmp_path}/"), f"{page}[{i}]", "exec"), namespace)
