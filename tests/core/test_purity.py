"""The domain core stays pure (DESIGN.md, "Rules of the house"; STYLE.md 1)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "coordinator/core").glob("*.py")),
    "coordinator/vllm/kv_events.py",
    "coordinator/audit/verify.py",
    "coordinator/audit/_verify_base.py",
    "coordinator/audit/_verify_blocks.py",
    "coordinator/audit/_verify_jobs.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "events").glob("_*.py")),
]
FORBIDDEN = {
    "sqlalchemy",
    "aiokafka",
    "torch",
    "anyio",
    "asyncio",
    "asyncpg",
    "socket",
    "os",
    "time",
    "random",
    "datetime",
    "uuid",
    "threading",
    "subprocess",
    "structlog",
    "sqlite3",
    "io",
    "pathlib",
}


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_no_io_clock_or_randomness(module: str) -> None:
    tree = ast.parse((ROOT / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{module} imports {sorted(imported & FORBIDDEN)}"


def test_importing_the_core_loads_no_io_library() -> None:
    code = (
        "import sys, json; import coordinator.core, coordinator.core.keys, events; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'sqlalchemy','aiokafka','torch','anyio','asyncpg','structlog'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle between modules (issue 18 found five: jobs <-> external, the timeline and
    its drawing, the sidecar's server, HTTP side and vLLM ingestion, the simulator's scheduler and
    workload, and seven CLI modules in one loop). An import made only for type checking counts
    too: it is a dependency all the same. Tarjan's strongly connected components of grimp's graph
    (grimp comes with import-linter, which checks the floors in `make test`)."""
    import grimp

    graph = grimp.build_graph("coordinator", "events", "gpu", cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in graph.modules:
                continue
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_public_surface_imports_on_first_use() -> None:
    """`from coordinator import Ledger` works for every name the package lists, and importing the
    package alone (as `import coordinator.core` does) loads none of them."""
    code = (
        "import sys, json, coordinator; before = 'coordinator.ledger.ledger' in sys.modules; "
        "names = {n: getattr(coordinator, n).__name__ for n in coordinator.__all__}; "
        "print(json.dumps([before, names]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    before, names = json.loads(out.stdout)
    assert before is False
    assert names == {name: name for name in names} and {"Ledger", "Sidecar", "EngineClient", "WorkerClient"} <= set(names)
