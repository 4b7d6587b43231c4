"""Every fenced code block in docs/ runs, and every shown output is what the code prints.

One test per page. A page's blocks run in order, in a fresh temporary working directory,
the way a reader would type them:

- ```` ```python ````: executed in one namespace per page (later blocks see earlier names);
  its standard output is captured.
- ```` ```python file=NAME ```` (also ``yaml``, ``text``): written to ``NAME`` in the page's
  directory (a script a later ``bash`` block launches, a config file), not executed here.
- ```` ```bash ````: run by ``bash -euo pipefail`` in the page's directory, with ``accelfn``
  and ``python`` on ``PATH`` meaning this interpreter and this checkout (``accelfn`` is
  ``python -m accelfn``); its standard output is captured. A non-zero exit fails the page.
  Those two commands are forked from a process that imported torch and accelfn once
  (``tests/helpers/preloaded.py``), each with the block's streams, directory and
  environment; the processes they start (a launch's workers) are fresh interpreters.
- ```` ```bash concurrent ````: each command (``\\``-continued lines joined; ``#`` lines are
  comments) is started at once and all must succeed: the two nodes of a multi-node example.
  In every bash block ``$NODE0_ADDR`` is 127.0.0.1 and the port ``29500`` becomes a free
  port (shown on the page as ``29500``, so output blocks may name it).
- ```` ```text output ````: the output of the block just before it, compared line by line
  (trailing spaces ignored; a line ``...`` stands for any lines, ``...`` inside a line for
  any text).
- Any other fence (``text``, ``yaml`` without ``file=``) is prose, not code.
- ``requires=cuda`` on a block: it runs only where torch sees a GPU; elsewhere the page's
  other blocks run and the test then reports the page as skipped, naming the blocks. (The
  pages avoid such blocks: a script with ``af.backends.auto()`` is the same on a GPU, so
  the CUDA specifics are prose.) ``requires=MODULE`` (``requires=torchft``): the same, where
  the optional package ``MODULE`` cannot be imported (``.ci/run`` installs it).

Pages that launch processes are marked ``multiprocess``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from tests.helpers import launch as _launch
from tests.helpers import preloaded as _preloaded

DOCS = _launch.ROOT / "docs"
FENCE = re.compile(r"^( *)```([^\n`]*)\n(.*?)^\1```[ \t]*$", re.DOTALL | re.MULTILINE)  # may be indented (in a list)
LAUNCH_TIMEOUT_S = 240
_NOT_RUN = "<a block that needs a GPU or an optional package, not run here>"


@attrs.frozen
class Block:
    language: str
    options: tuple[str, ...]
    code: str
    line: int  # 1-based line of the opening fence

    def option(self, name: str) -> str | None:
        for option in self.options:
            key, _, value = option.partition("=")
            if key == name:
                return value or key
        return None


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        language, *options = match.group(2).split()
        code = textwrap.dedent(match.group(3))
        found.append(Block(language, tuple(options), code, text.count("\n", 0, match.start()) + 1))
    return found


def pages() -> list:
    params = []
    for page in sorted(DOCS.glob("*.md")):
        launches = any(b.language == "bash" and "accelfn launch" in b.code for b in blocks(page))
        params.append(pytest.param(page, id=page.stem, marks=[pytest.mark.multiprocess] if launches else []))
    return params


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_preloaded.Preloaded]:
    """The server that runs the pages' ``python`` and ``accelfn`` commands with torch imported."""
    server = _preloaded.Preloaded(tmp_path_factory.mktemp("preloaded"), _launch.environment())
    yield server
    server.stop()


def shim(directory: Path, server: _preloaded.Preloaded) -> dict[str, str]:
    """An environment whose ``accelfn`` and ``python`` are this interpreter and this checkout
    (their commands forked by ``server``, with torch imported: ``tests/helpers/preloaded.py``)."""
    bin_dir = directory / ".bin"
    bin_dir.mkdir()
    for name in ("accelfn", "python"):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "{_preloaded.__file__}" {name} "$@"\n')
        path.chmod(0o755)
    return _launch.environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", NODE0_ADDR="127.0.0.1",
                               ACCELFN_DOCS_PRELOADED=str(server.socket))


def commands(code: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def run_bash(block: Block, cwd: Path, env: dict[str, str], where: str) -> str:
    port = str(_launch.free_port())
    scripts = commands(block.code) if block.option("concurrent") else [block.code]
    procs = [subprocess.Popen(["bash", "-euo", "pipefail", "-c", script.replace("29500", port)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for script in scripts]
    results = [_launch.finish(proc, timeout_s=LAUNCH_TIMEOUT_S) for proc in procs]
    for result in results:
        assert result.returncode == 0, (f"{where}: bash block exited {result.returncode}\n{block.code}\n"
                                        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return "".join(result.stdout for result in results).replace(port, "29500")


def run_python(block: Block, namespace: dict, where: str) -> str:
    out = io.StringIO()
    code = compile(block.code, where, "exec")
    with contextlib.redirect_stdout(out):
        exec(code, namespace)  # noqa: S102 - running the documentation is the point
    return out.getvalue()


def matches(expected: str, actual: str) -> bool:
    """``actual`` equals ``expected`` line by line; ``...`` is a wildcard (whole line or inside one)."""
    def norm(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())

    parts = []
    for line in norm(expected).splitlines():
        if line.strip() == "...":  # any whole lines: [^\n], as "." under DOTALL would make the
            # search try every way to cut the lines (seconds for a few dozen lines)
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"\n")
    return re.fullmatch("".join(parts), norm(actual) + "\n", re.DOTALL) is not None


def _missing(requires: str | None) -> str | None:
    """What a block's ``requires=`` needs that this machine lacks (None: it can run)."""
    if requires is None:
        return None
    if requires == "cuda":
        return None if torch.cuda.is_available() else "needs a CUDA GPU"
    return None if importlib.util.find_spec(requires) is not None else f"needs {requires}: pip install {requires}"


@pytest.mark.parametrize("page", pages())
def test_every_code_block_runs_and_shows_its_real_output(page: Path, tmp_path: Path, monkeypatch,
                                                         preloaded: _preloaded.Preloaded) -> None:
    """Each code block of the page runs without error, in order, and each ``text output``
    block equals what the block before it printed."""
    monkeypatch.chdir(tmp_path)
    for name in _launch._LAUNCH_VARS:  # a page runs as one fresh process would
        monkeypatch.delenv(name, raising=False)
    env = shim(tmp_path, preloaded)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    last_output: str | None = None
    ran = 0
    not_run = []
    for block in blocks(page):
        where = f"{page.relative_to(_launch.ROOT)}:{block.line}"
        target = block.option("file")
        if _missing(block.option("requires")):
            not_run.append(f"{where} ({_missing(block.option('requires'))})")
            last_output = _NOT_RUN
        elif target is not None:
            (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / target).write_text(block.code)
            last_output = None
        elif block.language == "python":
            last_output = run_python(block, namespace, where)
            ran += 1
        elif block.language == "bash":
            last_output = run_bash(block, tmp_path, env, where)
            ran += 1
        elif block.option("output") and last_output is not _NOT_RUN:
            assert last_output is not None, f"{where}: an output block must follow a python or bash block"
            assert matches(block.code, last_output), (
                f"{where}: the page shows\n{block.code}\nbut the code printed\n{last_output}")
            last_output = None
    assert ran, f"{page.name} has no code block to run"
    if not_run:
        pytest.skip(f"not run here: {', '.join(not_run)} (all other blocks passed)")
