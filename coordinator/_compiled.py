"""Which modules of the pure core run compiled, and the rule that keeps a stale build from running.

setup.py compiles each module of coordinator/core with Cython into an extension module beside
its source, and writes each one's source digest (SHA-256) into coordinator/core/_compiled.json.
Python imports an extension module in place of the .py beside it. `install`, run by
coordinator/__init__.py before any module of the core is imported, sends the import of a core
module to its source instead when

* the source is not the one compiled: edited since, or no digest vouches for the extension
  (one built by hand, or by an older build); or
* `KVLEDGER_PURE_PYTHON=1` is set: to step through the core in a debugger, or to compare.

So a build never runs code other than its source's, and the core runs as Python where it could
not be compiled at all (no C compiler). `status()` says which way each module runs; benchmarks
print `summary()` beside their figures.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

CORE = Path(__file__).resolve().parent / "core"
PACKAGE = "coordinator.core"
MANIFEST = CORE / "_compiled.json"
PURE_PYTHON = "KVLEDGER_PURE_PYTHON"

COMPILED = "compiled"
EDITED = "Python: its source changed since it was compiled"
UNVOUCHED = "Python: no digest of its source vouches for its build"
FORCED = f"Python: {PURE_PYTHON}=1"
NOT_COMPILED = "Python: not compiled"


class _FromSource(importlib.abc.MetaPathFinder):
    """Finds the listed core modules as their .py files, ahead of the extension beside them."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, CORE / f"{fullname.rsplit('.', 1)[1]}.py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_status() -> dict[str, str]:
    """Each core module (but the package's __init__) and how it runs."""
    try:
        vouched: dict[str, str] = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        vouched = {}
    extensions = {
        path.name[: -len(suffix)] for suffix in importlib.machinery.EXTENSION_SUFFIXES for path in CORE.glob(f"*{suffix}")
    }
    forced = os.environ.get(PURE_PYTHON) == "1"
    status = {}
    for source in sorted(CORE.glob("*.py")):
        name = source.stem
        if name == "__init__":
            continue
        if name not in extensions:
            status[name] = NOT_COMPILED
        elif forced:
            status[name] = FORCED
        elif name not in vouched:
            status[name] = UNVOUCHED
        elif vouched[name] != _digest(source):
            status[name] = EDITED
        else:
            status[name] = COMPILED
    return status


_STATUS: dict[str, str] = {}


def install() -> None:
    """Route the imports of core modules that must run as Python to their sources (once)."""
    if _STATUS:
        return
    _STATUS.update(_read_status())
    from_source = frozenset(f"{PACKAGE}.{name}" for name, how in _STATUS.items() if how in (EDITED, UNVOUCHED, FORCED))
    if from_source:
        sys.meta_path.insert(0, _FromSource(from_source))


def status() -> dict[str, str]:
    """Each core module's name and how it runs: COMPILED or why it runs as Python."""
    install()
    return dict(_STATUS)


def summary() -> str:
    """One line for a benchmark's output: how many core modules run compiled, and why not the rest."""
    how = status()
    compiled = sum(1 for way in how.values() if way == COMPILED)
    reasons = sorted({way.removeprefix("Python: ") for way in how.values() if way != COMPILED})
    line = f"core: {compiled} of {len(how)} modules compiled with Cython (setup.py)"
    return line + (f"; the rest run as Python ({'; '.join(reasons)})" if reasons else "")
