"""The shape of the package: its import contract (import-linter), its types (mypy), its size."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.background import Mypy

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=root, env={"PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contract_holds() -> None:
    """import-linter finds every layer importing only the layers below it, and no module
    importing the package root (pyproject.toml's contracts)."""
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("accelfn/transforms/clip.py", "from accelfn.loop import run", "Layers: arrows point down only BROKEN"),
    ("accelfn/checkpoint/save_load.py", "from accelfn.backends import auto", "Layers: arrows point down only BROKEN"),
    ("accelfn/cli/commands.py", "import accelfn", "Nothing imports the package root BROKEN"),
])
def test_a_forbidden_import_breaks_the_contract(tmp_path, module, line, broken) -> None:
    """Adding an upward import, or an import of the package root, to a copy of the package
    makes import-linter fail and name the broken contract."""
    shutil.copytree(ROOT / "accelfn", tmp_path / "accelfn")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


def test_mypy_is_clean(mypy: Mypy) -> None:
    """mypy (configured in pyproject.toml) reports no error in accelfn/ (run in the background
    from the start of the session: tests/helpers/background.py)."""
    result = mypy.result()
    assert result.returncode == 0, result.stdout + result.stderr


PACKAGE_FILES = {"__init__.py", "__main__.py", "py.typed", "_version.py", "__pycache__"}


def test_the_top_level_holds_one_entry_per_concept_and_no_module_is_long() -> None:
    """Besides the package's own files, accelfn/ has at most 13 entries, one per concept, and
    no module is over 600 lines (one concept per module; a module is never cut only to stay
    under the cap)."""
    entries = sorted(p.name for p in (ROOT / "accelfn").iterdir() if p.name not in PACKAGE_FILES)
    assert len(entries) <= 13, entries
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "accelfn").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_every_module_names_its_concept_in_its_first_docstring_line() -> None:
    """Every module of accelfn/ has a docstring whose first line says what it holds."""
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "accelfn").rglob("*.py")
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not missing, missing


def test_the_checkpoint_package_is_cut_along_the_flow_of_a_save() -> None:
    """accelfn/checkpoint/ holds at most 13 modules (its __init__ included)."""
    modules = sorted(p.name for p in (ROOT / "accelfn" / "checkpoint").glob("*.py"))
    assert len(modules) <= 13, modules
