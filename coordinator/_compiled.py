"""Which modules of the pure core run compiled, and the rule that keeps a stale build from running.

setup.py compiles each module of coordinator/core with Cython into an extension module beside
its source, and writes each one's source digest (SHA-256) into coordinator/core/_compiled.json.
Python imports an extension module in place of the .py beside it. `install`, run by
coordinator/__init__.py before any module of the core is imported, sends the import of a core
module to its source instead when

* the source is not the one compiled: edited since, or no digest vouches for the extension
  (one built by hand, by an older build, or a manifest that cannot be read); or
* `KVLEDGER_PURE_PYTHON=1` is set: to step through the core in a debugger, or to compare;

and refuses to import a compiled module whose source is gone (left by an old build). So a
build never runs code other than its source's, and the core runs as Python where it could not
be compiled at all (no C compiler). The decision is taken once, when the process starts:
`importlib.reload` of a compiled module does not run an edited source. `status()` says which
way each module runs; benchmarks print `summary()` beside their figures.
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
"""A module's status when its compiled build runs; every other status says why its source runs."""
NOT_COMPILED = "not compiled"
EDITED = "source changed since it was compiled"
UNVOUCHED = "no digest of its source vouches for its build"
FORCED = f"{PURE_PYTHON}=1"
ORPHANED = "source gone: its build is left from an old one and is not imported"


class _FromSource(importlib.abc.MetaPathFinder):
    """Finds the listed core modules as their .py files, ahead of the extension beside them, and
    refuses the orphaned ones."""

    def __init__(self, from_source: frozenset[str], orphaned: frozenset[str]) -> None:
        self.from_source = from_source
        self.orphaned = orphaned

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.orphaned:
            raise ModuleNotFoundError(f"{fullname}: {ORPHANED} ({CORE}); `make install` removes it", name=fullname)
        if fullname not in self.from_source:
            return None
        return importlib.util.spec_from_file_location(fullname, CORE / f"{fullname.rsplit('.', 1)[1]}.py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _vouched() -> dict[str, str]:
    """The source digest of each module the last build compiled ({} without a readable manifest)."""
    try:
        modules = json.loads(MANIFEST.read_text()).get("modules")
    except (OSError, ValueError, AttributeError):
        return {}
    return modules if isinstance(modules, dict) else {}


def _read_status() -> dict[str, str]:
    """Each core module (but the package's __init__), its build's included, and how it runs."""
    vouched = _vouched()
    built = set()
    for path in CORE.iterdir():
        # The most specific suffix decides the name: decider.cpython-311-x86_64-linux-gnu.so is decider.
        suffix = next((suffix for suffix in importlib.machinery.EXTENSION_SUFFIXES if path.name.endswith(suffix)), None)
        if suffix is not None:
            built.add(path.name[: -len(suffix)])
    sources = {path.stem: path for path in CORE.glob("*.py") if path.stem != "__init__"}
    forced = os.environ.get(PURE_PYTHON) == "1"
    status = {}
    for name in sorted(sources.keys() | built):
        if name not in sources:
            status[name] = ORPHANED
        elif name not in built:
            status[name] = NOT_COMPILED
        elif forced:
            status[name] = FORCED
        elif name not in vouched:
            status[name] = UNVOUCHED
        elif vouched[name] != _digest(sources[name]):
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
    orphaned = frozenset(f"{PACKAGE}.{name}" for name, how in _STATUS.items() if how == ORPHANED)
    if from_source or orphaned:
        sys.meta_path.insert(0, _FromSource(from_source, orphaned))


def status() -> dict[str, str]:
    """Each core module's name and how it runs: COMPILED, or why its source runs instead."""
    install()
    return dict(_STATUS)


def summary() -> str:
    """One line for a benchmark's output: how many core modules run compiled, and why not the rest."""
    how = status()
    compiled = sum(1 for way in how.values() if way == COMPILED)
    reasons = sorted({way for way in how.values() if way != COMPILED})
    line = f"core: {compiled} of {len(how)} modules compiled with Cython (setup.py)"
    return line + (f"; the rest run as Python ({'; '.join(reasons)})" if reasons else "")
