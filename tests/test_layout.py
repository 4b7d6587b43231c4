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
    """accelfn/checkpoint/ holds at most 15 modules (its __init__ included): 13 before the
    manifest's schema (``_manifest``), the frozen base written once (``_frozen``) and PEFT's
    export layouts (``_adapters``) each became a module of its own (issues 34 and 37)."""
    modules = sorted(p.name for p in (ROOT / "accelfn" / "checkpoint").glob("*.py"))
    assert len(modules) <= 15, modules


def _import_graph() -> dict[str, set[str]]:
    """Every accelfn module and the accelfn modules it imports at run time (imports under
    ``if TYPE_CHECKING:`` name types only and are left out, as in the import contract)."""
    import grimp

    graph = grimp.build_graph("accelfn", exclude_type_checking_imports=True)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_no_module_imports_itself_through_others() -> None:
    """The import graph of the package has no circle (a package's ``__init__`` counts as the
    module of its folder): every import points one way."""
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_backends_hold_how_a_program_runs_on_hardware_only() -> None:
    """accelfn/backends/ holds at most 12 modules (its __init__ included) and base.py at most 400
    lines; what torch.distributed does to a model lives in accelfn/distributed/, below it."""
    modules = sorted(p.name for p in (ROOT / "accelfn" / "backends").glob("*.py"))
    assert len(modules) <= 12, modules
    assert len((ROOT / "accelfn" / "backends" / "base.py").read_text().splitlines()) <= 400


#: names that would mean prepare knows a parallelism: transforms, their verbs, their modules
PARALLELISMS = ("Replicate", "ShardParams", "TensorParallel", "Pipeline", "DeepSpeed", "Invariant", "Compile",
                "replicate", "shard_params", "tensor_parallel", "pipeline", "deepspeed", "invariant", "fsdp", "ddp",
                "meta", "materialize", "canonical")


def test_the_function_that_prepares_a_program_names_no_parallelism() -> None:
    """``Backend.prepare``'s code (its docstring aside) names no transform, verb or
    parallelism module: it runs the phase table."""
    source = (ROOT / "accelfn" / "backends" / "base.py").read_text()
    tree = ast.parse(source)
    (backend,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Backend"]
    (prepare,) = [n for n in backend.body if isinstance(n, ast.FunctionDef) and n.name == "prepare"]
    body = prepare.body[1:] if ast.get_docstring(prepare) else prepare.body
    names = {node.id for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.Name)}
    names |= {node.attr for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.Attribute)}
    assert not names & set(PARALLELISMS), names & set(PARALLELISMS)


def _public_order(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions and modules, each alphabetically (isort's order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2), name


def test_the_package_face_is_grouped_and_sorted() -> None:
    """accelfn/__init__.py holds only the public names: imports in groups, each under a comment
    saying what it holds, each import's names sorted; ``__all__`` is every imported name, sorted."""
    source = (ROOT / "accelfn" / "__init__.py").read_text()
    tree = ast.parse(source)
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert all(isinstance(node, (ast.ImportFrom, ast.Assign)) for node in tree.body[1:]), "imports and __all__ only"
    imported = [alias.asname or alias.name for node in imports for alias in node.names]
    for node in imports:
        names = [alias.name for alias in node.names]
        assert names == sorted(names, key=_public_order), (node.module, names)
    lines = source.splitlines()
    ends = [0, *(node.end_lineno or node.lineno for node in imports)]
    groups = [node.lineno for node, end in zip(imports, ends) if node.lineno - 1 != end]  # after a blank or comment
    assert len(groups) >= 5 and all(lines[start - 2].startswith("# ") for start in groups), groups
    (assign,) = [node for node in tree.body if isinstance(node, ast.Assign)]
    public = ast.literal_eval(assign.value)
    assert public == sorted(public, key=_public_order)
    assert sorted(public) == sorted(imported)
