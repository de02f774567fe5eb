"""Compiles kvledger's pure core (coordinator/core) with Cython when kvledger is installed.

Everything else about the package is in pyproject.toml; this file only adds the extensions.
Each module of the core is compiled as it is: the same Python source, made into an extension
module that Python imports in place of the .py beside it. Nothing is rewritten for Cython, so
the source stays the one truth, and the core still runs as plain Python wherever it is not
compiled. The Mooncake trace through the core (`ops/bench/trace.py --core-only`) ran 260-276k
blocks/s compiled against 197-208k as Python (KVLEDGER_PURE_PYTHON=1), in alternated runs
(README, "Benchmarks"); the projector's fold alone gains nothing measurable.

* Cython reads the annotations as Python's own (`annotation_typing` off): an `x: float` stays a
  Python object, as it is in the source, so an event holds the very value it would as Python.
* Every extension is optional: with no C compiler or no Python headers the build says so and
  kvledger runs as Python.
* `KVLEDGER_PURE_PYTHON=1` while installing builds none; while running, it runs the core as
  Python even where it is compiled (coordinator/_compiled.py), to step through it in a debugger.
* Beside the extensions the build writes `coordinator/core/_compiled.json`, each compiled
  module's source digest (SHA-256). A module edited since runs from its source, never from a
  stale build (coordinator/_compiled.py); `make test` and `make run` compile it again first,
  and the build compiles again each module whose digest changed, whatever the file times say.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CORE = Path("coordinator") / "core"
MANIFEST = "_compiled.json"


def core_sources() -> list[Path]:
    """The modules compiled: every module of the core but its package's __init__."""
    return sorted(path for path in CORE.glob("*.py") if path.name != "__init__.py")


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vouched() -> dict[str, str]:
    """The digests the last build wrote: the source each compiled module was built from."""
    try:
        return dict(json.loads((CORE / MANIFEST).read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def changed() -> set[str]:
    """The modules whose source is not the one their build was made from (or that have none)."""
    built = vouched()
    return {path.stem for path in core_sources() if built.get(path.stem) != source_digest(path)}


class BuildCore(build_ext):
    """build_ext that compiles again every module whose source changed (by digest, not by file
    times), and writes, beside the modules it compiled, the digest of each one's source."""

    def run(self) -> None:
        digests = {path.stem: source_digest(path) for path in core_sources()}  # before the compiler reads them
        stale = changed()
        for extension in self.extensions:
            if _stem(extension) in stale:
                # Its old builds go (in build/ and, for --inplace, beside the source): a compile
                # that fails must leave nothing behind to be copied in place and vouched for.
                filename = self.get_ext_filename(extension.name)
                for target in (Path(self.build_lib) / filename, Path(filename)):
                    target.unlink(missing_ok=True)
        super().run()
        built: dict[str, str] = {}
        directory = None
        for extension in self.extensions:
            target = Path(self.get_ext_fullpath(extension.name))
            directory = target.parent
            if target.exists():  # an optional extension that failed to build is not there
                built[_stem(extension)] = digests[_stem(extension)]
        if directory is not None:
            (directory / MANIFEST).write_text(json.dumps(built, indent=1, sort_keys=True) + "\n")


def _stem(extension: Extension) -> str:
    return str(extension.name.rsplit(".", 1)[1])


def extensions() -> list[Extension]:
    if os.environ.get("KVLEDGER_PURE_PYTHON") == "1":
        return []
    from Cython.Build import cythonize  # a build requirement (pyproject.toml, [build-system])

    stale = changed()
    modules = []
    for path in core_sources():
        modules += cythonize(
            [Extension(f"coordinator.core.{path.stem}", [str(path)], optional=True)],
            build_dir="build/cython",  # the generated C stays out of the source tree
            language_level=3,
            compiler_directives={"annotation_typing": False},
            force=path.stem in stale,  # its C again even where file times say it is up to date
            quiet=True,
        )
    return modules


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildCore})
