"""The tree shows the processes: who may import whom (../shared/DESIGN.md, "Who may import whom").

- messages/ imports nothing of ours; kernels/ only kernels/ (torch and triton outside).
- A process folder (actors/engine, scheduler, block_manager, worker, supervisor; gateway/)
  imports actors/runtime, messages, kernels and itself, never another process's folder: what
  two processes share is a message, or it lives in actors/runtime.
- actors/runtime imports messages only (and itself).
- No import circle inside a folder, TYPE_CHECKING imports included (a shared record such as
  CachedRequest or SampleRow has a module of its own).
- Only cli/ (and the package root's offline API) wires processes together.

The imports are read from the source (ast), every `import` and `from` statement anywhere in a
module, so a function-local or TYPE_CHECKING import counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROCESS_FOLDERS = (
    "actors.engine",
    "actors.scheduler",
    "actors.block_manager",
    "actors.worker",
    "actors.supervisor",
    "gateway",
)
RUNTIME = "actors.runtime"
LIBRARY_DIRS = ("actors", "messages", "kernels", "gateway", "cli", "weights")


def module_name(path: Path, root: Path) -> str:
    """actors/engine/engine.py -> actors.engine.engine (package-relative, no `actorserve.`)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> set[str]:
    """The package-relative modules (or packages) `path` imports, `actorserve.` stripped.

    `from pkg import name` counts as an import of pkg.name where that is a module of ours, else
    of pkg."""
    own = module_name(path, root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            found.update(t.removeprefix("actorserve.") for t in targets if _ours(t))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and _ours(node.module):
                target = node.module.removeprefix("actorserve").lstrip(".")
            else:
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                is_module = _module_path(root, full) is not None
                found.add(full if is_module else target)
    found.discard("")
    return found


def _ours(name: str) -> bool:
    return name == "actorserve" or name.startswith("actorserve.")


def _module_path(root: Path, name: str) -> Path | None:
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def library_modules(root: Path) -> dict[str, Path]:
    modules = {}
    for top in LIBRARY_DIRS:
        for path in sorted((root / top).rglob("*.py")):
            modules[module_name(path, root)] = path
    for path in sorted(root.glob("*.py")):
        modules[module_name(path, root)] = path
    return modules


def folder_of(module: str) -> str:
    """The folder a module's rule is stated for: a process folder, actors.runtime, or the top."""
    for folder in (*PROCESS_FOLDERS, RUNTIME):
        if module == folder or module.startswith(folder + "."):
            return folder
    return module.partition(".")[0]


def allowed(importer: str, imported: str) -> bool:
    """DESIGN.md's rule for one edge (both package-relative module names)."""
    source, target = folder_of(importer), folder_of(imported)
    if source == target:
        return True
    if source == "messages":
        return False
    if source == "kernels":
        return False
    if source == RUNTIME:
        return target == "messages"
    if source in PROCESS_FOLDERS:
        return target in (RUNTIME, "messages", "kernels")
    return True  # cli/, weights/ and the package root wire the rest together


def rule_breaks(root: Path) -> list[str]:
    breaks = []
    for name, path in library_modules(root).items():
        for imported in sorted(imports_of(path, root)):
            if not allowed(name, imported):
                breaks.append(f"{name} imports {imported}")
    return breaks


def folder_circles(root: Path) -> list[list[str]]:
    """Import circles among the modules of one folder (a module and the modules it imports in
    the same directory), each as the list of modules around it."""
    modules = library_modules(root)
    graph = {
        name: {
            m
            for m in imports_of(path, root)
            if m in modules and m != name and modules[m].parent == path.parent
        }
        for name, path in modules.items()
    }
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_every_import_follows_the_rule():
    assert rule_breaks(ROOT) == []


def test_no_folder_has_an_import_circle():
    assert folder_circles(ROOT) == []


def test_each_process_has_its_folder_with_a_header():
    for folder in (*PROCESS_FOLDERS, RUNTIME):
        init = ROOT.joinpath(*folder.split("."), "__init__.py")
        docstring = ast.get_docstring(ast.parse(init.read_text()))
        assert docstring, f"{init} has no docstring naming its process"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the library's sources, to plant imports in."""
    for path in library_modules(ROOT).values():
        out = tmp_path / path.relative_to(ROOT)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(path.read_text())
    return tmp_path


@pytest.mark.parametrize(
    ("module", "planted", "expected"),
    [
        (
            "actors/engine/engine.py",
            "from ..scheduler.step_planner import StepPlanner\n",
            "actors.engine.engine imports actors.scheduler.step_planner",
        ),
        (
            "actors/scheduler/scheduler.py",
            "from ..block_manager import block_pool\n",
            "actors.scheduler.scheduler imports actors.block_manager.block_pool",
        ),
        (
            "actors/worker/runner.py",
            "from actorserve.actors.engine.detokenizer import Detokenizer\n",
            "actors.worker.runner imports actors.engine.detokenizer",
        ),
        (
            "gateway/replicas.py",
            "from ..actors.block_manager.block_pool import BlockPool\n",
            "gateway.replicas imports actors.block_manager.block_pool",
        ),
        (
            "actors/runtime/config.py",
            "from ..worker import loader\n",
            "actors.runtime.config imports actors.worker.loader",
        ),
        (
            "kernels/reference.py",
            "from ..actors.runtime import config\n",
            "kernels.reference imports actors.runtime.config",
        ),
        (
            "messages/common.py",
            "from ..kernels import reference\n",
            "messages.common imports kernels.reference",
        ),
    ],
)
def test_a_planted_cross_process_import_is_caught(tree: Path, module, planted, expected):
    path = tree / module
    path.write_text(path.read_text() + "\n\ndef planted():\n    " + planted)
    assert rule_breaks(tree) == [expected]


def test_a_planted_circle_is_caught(tree: Path):
    path = tree / "actors" / "worker" / "kv_cache.py"
    path.write_text(path.read_text() + "\nfrom .runner import ModelRunner  # noqa\n")
    circles = folder_circles(tree)
    assert circles and all("actors.worker.kv_cache" in circle for circle in circles)
