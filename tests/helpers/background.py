"""mypy over accelfn/ in a background process, started when the session's tests are known.

mypy spends most of a minute reading torch's stubs, on one core, printing nothing until it
ends. ``tests/conftest.py`` starts it as soon as collection has selected
``tests/test_layout.py::test_mypy_is_clean``, so that it runs on the core the suite's
single-process stretches leave idle; the test then waits for its outcome. Under
pytest-xdist the controller starts it before the workers and hands each worker the path of
its output (``Mypy.attach``), so that it runs once, whichever worker gets the test. Run
alone, the test starts it itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MYPY_TEST = "tests/test_layout.py::test_mypy_is_clean"
TIMEOUT_S = 300
# runs mypy with its output in OUTPUT, then writes its exit status to OUTPUT.status (atomically)
_RUNNER = """\
import os, subprocess, sys
with open(sys.argv[1], "w") as out:
    code = subprocess.call([sys.executable, "-m", "mypy"], stdout=out, stderr=subprocess.STDOUT)
with open(sys.argv[1] + ".tmp", "w") as status:
    status.write(str(code))
os.replace(sys.argv[1] + ".tmp", sys.argv[1] + ".status")
"""


class Mypy:
    """One ``python -m mypy`` run in ``ROOT`` (configured in pyproject.toml), its output in
    the file ``output`` and its exit status in ``output.status`` once it ends."""

    def __init__(self, output: Path | None = None) -> None:
        self.output = output or Path(tempfile.mkdtemp(prefix="accelfn-mypy-")) / "mypy.out"
        self.proc: subprocess.Popen | None = None
        if output is None:  # started here
            self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(self.output)], cwd=ROOT,
                                         start_new_session=True)

    @classmethod
    def attach(cls, output: str | os.PathLike[str]) -> Mypy:
        """The run another process (pytest-xdist's controller) started, writing to ``output``."""
        return cls(Path(output))

    def result(self, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        """Waits for mypy (fails the test after ``timeout_s``); its exit status and output."""
        status = Path(f"{self.output}.status")
        deadline = time.monotonic() + timeout_s
        while not status.exists():
            if self.proc is not None and self.proc.poll() is not None and not status.exists():
                raise AssertionError(f"the mypy runner exited with {self.proc.returncode} and no status")
            if time.monotonic() > deadline:
                raise AssertionError(f"mypy did not finish within {timeout_s} s")
            time.sleep(0.2)
        return subprocess.CompletedProcess(["mypy"], int(status.read_text()), self.output.read_text(), "")

    def stop(self) -> None:
        """Ends mypy if this process started it and it still runs (the session ended without
        its test), and removes its output."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.output.parent, ignore_errors=True)
