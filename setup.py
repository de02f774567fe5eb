"""Compiles kvledger's pure core (coordinator/core) with Cython when kvledger is installed.

Everything else about the package is in pyproject.toml; this file only adds the extensions.
Each module of the core is compiled as it is: the same Python source, made into an extension
module that Python imports in place of the .py beside it. Nothing is rewritten for Cython, so
the source stays the one truth, and the core still runs as plain Python wherever it is not
compiled. The Mooncake trace through the core (`ops/bench/trace.py --core-only`) ran 260-276k
blocks/s compiled against 197-208k as Python (KVLEDGER_PURE_PYTHON=1), in alternated runs
(ops/bench/README.md); the projector's fold alone gains nothing measurable.

* Cython reads the annotations as Python's own (`annotation_typing` off): an `x: float` stays a
  Python object, as it is in the source, so an event holds the very value it would as Python.
* Nothing here is required: a module Cython cannot translate, or with no C compiler or no
  Python headers, the build says so and that module runs as Python.
* `KVLEDGER_PURE_PYTHON=1` while installing builds none; while running, it runs the core as
  Python even where it is compiled (coordinator/_compiled.py), to step through it in a debugger.
* Beside the extensions the build writes `coordinator/core/_compiled.json`: the build's
  settings (Cython's version, the directives, Python's) and each compiled module's source
  digest (SHA-256), taken before Cython reads the source. A module edited since runs from its
  source, never from a stale build (coordinator/_compiled.py). `make test` and `make run`
  compile again first, and a build compiles again each module whose digest changed, whatever
  the file times say, and every module when the settings changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CORE = ROOT / "coordinator" / "core"
MANIFEST = "_compiled.json"
DIRECTIVES = {"annotation_typing": False}


def core_sources() -> list[Path]:
    """The modules compiled: every module of the core but its package's __init__."""
    return sorted(path for path in CORE.glob("*.py") if path.name != "__init__.py")


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def settings(cython_version: str) -> str:
    """What a build depends on beside the sources: a change of any compiles every module again."""
    return f"cython {cython_version}, directives {sorted(DIRECTIVES.items())}, python {sys.version.split()[0]}"


def read_manifest(directory: Path = CORE) -> dict[str, object]:
    """The last build's manifest ({} when there is none or it is unreadable)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def stale(digests: dict[str, str], current_settings: str, manifest: dict[str, object]) -> set[str]:
    """The modules to compile again: those whose source is not the one their build was made
    from (or that have no build on record), and all of them when the settings changed."""
    built = manifest.get("modules")
    if manifest.get("settings") != current_settings or not isinstance(built, dict):
        return set(digests)
    return {name for name, digest in digests.items() if built.get(name) != digest}


class BuildCore(build_ext):
    """build_ext that leaves no build of a stale module behind (so a compile that fails cannot be
    vouched for), and writes the manifest beside the modules it compiled. `digests` and
    `settings` are set by extensions(), before Cython reads a source."""

    digests: dict[str, str] = {}
    settings = ""
    stale: set[str] = set()

    def run(self) -> None:
        for name in self.stale:
            # Its old builds go (in build/ and beside the source): a compile that fails, or a
            # source Cython cannot translate, must leave nothing behind to be copied in place.
            for directory in (Path(self.build_lib) / "coordinator" / "core", CORE):
                old = built_modules(directory).get(name) if directory.is_dir() else None
                if old is not None:
                    old.unlink()
        super().run()
        if not self.extensions:
            return
        directory = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        for name, path in built_modules(directory).items():
            if name not in self.digests:
                path.unlink()  # the build of a module whose source is gone
        compiled = {
            _stem(extension): self.digests[_stem(extension)]
            for extension in self.extensions
            if Path(self.get_ext_fullpath(extension.name)).exists()  # one that failed is not there
        }
        manifest = json.dumps({"settings": self.settings, "modules": compiled}, indent=1, sort_keys=True) + "\n"
        partial = directory / f"{MANIFEST}.partial"
        partial.write_text(manifest)
        partial.replace(directory / MANIFEST)  # whole or not at all


def _stem(extension: Extension) -> str:
    return str(extension.name.rsplit(".", 1)[1])


def built_modules(directory: Path) -> dict[str, Path]:
    """The modules built in `directory`, by name, and their files (the most specific suffix
    decides the name: decider.cpython-311-x86_64-linux-gnu.so is decider)."""
    built = {}
    for path in directory.iterdir():
        suffix = next((suffix for suffix in EXTENSION_SUFFIXES if path.name.endswith(suffix)), None)
        if suffix is not None:
            built[path.name[: -len(suffix)]] = path
    return built


def extensions() -> list[Extension]:
    if os.environ.get("KVLEDGER_PURE_PYTHON") == "1":
        return []
    import Cython  # a build requirement (pyproject.toml, [build-system])
    from Cython.Build import cythonize
    from Cython.Compiler.Errors import CompileError

    BuildCore.digests = {path.stem: source_digest(path) for path in core_sources()}  # before Cython reads them
    BuildCore.settings = settings(Cython.__version__)
    BuildCore.stale = stale(BuildCore.digests, BuildCore.settings, read_manifest())
    modules = []
    for path in core_sources():
        try:
            translated = cythonize(
                [Extension(f"coordinator.core.{path.stem}", [str(path.relative_to(ROOT))])],
                build_dir="build/cython",  # the generated C stays out of the source tree
                language_level=3,
                compiler_directives=DIRECTIVES,
                force=path.stem in BuildCore.stale,  # its C again even where file times say it is up to date
                quiet=True,
            )
        except CompileError as error:
            print(f"setup.py: Cython could not translate {path} ({error}); it runs as Python", file=sys.stderr)
            continue
        for extension in translated:
            extension.optional = True  # a C compile that fails warns (cythonize drops the flag: set here)
        modules += translated
    return modules


if __name__ == "__main__":  # as `python setup.py ...` and as setuptools' build backend runs it
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildCore})
