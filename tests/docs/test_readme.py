"""The README's quickstart runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs(tmp_path, monkeypatch):
    """The Python block under "Quickstart" trains, checkpoints and reloads as shown."""
    text = README.read_text()
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(os.environ, "ACCELFN_BACKEND", "cpu")
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    assert namespace["state"].step == 12  # 3 epochs x 16 micro-batches / accumulate(4)
    assert sorted(p.name for p in (tmp_path / "runs" / "ckpt").iterdir()) == ["step_00000005", "step_00000010"]
    assert (tmp_path / "runs" / "final" / "manifest.json").is_file()
