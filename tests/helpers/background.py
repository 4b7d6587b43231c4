"""mypy over accelfn/ in a background process, started when the session's tests are known.

mypy spends most of a minute reading torch's stubs, on one core, printing nothing until it
ends. ``tests/conftest.py`` starts it as soon as collection has selected
``tests/test_layout.py::test_mypy_is_clean``, so that it runs on the core the suite's
single-process stretches leave idle; the test then waits for its outcome. Run alone, the
test starts it itself.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MYPY_TEST = "tests/test_layout.py::test_mypy_is_clean"
TIMEOUT_S = 300


class Mypy:
    """One ``python -m mypy`` run in ``ROOT`` (configured in pyproject.toml), its output in a temporary file."""

    def __init__(self) -> None:
        self.output = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, stdout=self.output,
                                     stderr=subprocess.STDOUT, text=True)

    def result(self, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        """Waits for mypy (fails the test after ``timeout_s``); its exit status and output."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"mypy did not finish within {timeout_s} s") from None
        self.output.seek(0)
        text = self.output.read()
        self.output.close()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, text, "")

    def stop(self) -> None:
        """Ends mypy if it still runs (the session ended without its test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
