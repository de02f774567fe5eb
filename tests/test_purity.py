"""The domain core stays pure (DESIGN.md, "Rules of the house"; STYLE.md 1)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
