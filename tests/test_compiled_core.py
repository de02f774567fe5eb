"""The pure core compiled with Cython (setup.py) runs only as its own source, and decides as it does.

`make install` compiles each module of coordinator/core beside its source; coordinator/_compiled.py
runs a module from its .py when the source changed since, when no digest vouches for the build,
or under KVLEDGER_PURE_PYTHON=1, and refuses a build whose source is gone. setup.py compiles again
what changed, by digest and by build settings. On a machine with no C compiler nothing is
compiled and the tests that need a build skip, saying so; CI sets KVLEDGER_REQUIRE_COMPILED=1
(.ci/run), so there they fail instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator import _compiled

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_COMPILED = os.environ.get("KVLEDGER_REQUIRE_COMPILED") == "1"

PROBE = """
import json, sys
import coordinator.core.routing as routing, coordinator.core.decider as decider
from coordinator import _compiled
print(json.dumps({
    "routing": routing.__file__, "decider": decider.__file__, "status": _compiled.status(),
    "edited": hasattr(routing, "EDITED_AFTER_THE_BUILD"),
}))
"""

STATUS = "import json; from coordinator import _compiled; print(json.dumps(_compiled.status()))"

REPLAY = """
import json
from coordinator import _compiled
from coordinator.core.state import state_digest
from coordinator.simulator.trace import SHIPPED_TRACE, CoreReplay, read_trace

replay = CoreReplay(slots=2_000, engines=2)
hit = replay.replay_all(read_trace(SHIPPED_TRACE))
print(json.dumps({"status": _compiled.status(), "hit": hit, "digest": state_digest(replay.core.state)}))
"""


def built() -> dict[str, str]:
    """The real tree's status; skips (or fails, in CI) where nothing was compiled."""
    status = _compiled.status()
    if not any(how == _compiled.COMPILED for how in status.values()):
        message = f"the core is not compiled here ({_compiled.summary()}): `make install` compiles it (setup.py)"
        if REQUIRE_COMPILED:
            pytest.fail(message)
        pytest.skip(message)
    return status


def run(code: str, cwd: Path, **environment: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=environ(cwd, **environment), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def environ(tree: Path, **environment: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != _compiled.PURE_PYTHON}
    env.update(environment, PYTHONPATH=str(tree))
    return env


def build_in_place(tree: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("Cython", reason="the build needs Cython (`make install` puts it in .venv)")
    command = [sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"]
    return subprocess.run(command, cwd=tree, env=environ(tree, **environment), capture_output=True, text=True, timeout=600)


def setup_script() -> Any:
    """setup.py as a module: its functions, without running the build (its __main__ guard)."""
    spec = importlib.util.spec_from_file_location("kvledger_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_of_the_tree(destination: Path) -> Path:
    """coordinator/ and events/ with their builds, setup.py and build/ (file times kept), where
    a test may edit and build them."""
    for package in ("coordinator", "events"):
        shutil.copytree(ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "setup.py", destination / "setup.py")
    if (ROOT / "build").is_dir():  # the generated C, and the builds an in-place build copies from
        shutil.copytree(ROOT / "build", destination / "build")
    return destination


def test_every_core_module_runs_compiled_after_the_install() -> None:
    status = built()
    assert status == dict.fromkeys(status, _compiled.COMPILED)
    import coordinator.core.decider as decider

    assert not decider.__file__.endswith(".py"), decider.__file__


def test_a_core_module_edited_since_the_build_runs_from_its_source(tmp_path: Path) -> None:
    built()
    tree = copy_of_the_tree(tmp_path)
    with (tree / "coordinator/core/routing.py").open("a") as source:
        source.write("\nEDITED_AFTER_THE_BUILD = True\n")

    seen = run(PROBE, tree)

    assert seen["routing"] == str(tree / "coordinator/core/routing.py")
    assert seen["edited"], "the edited module ran as its stale build"
    assert seen["status"]["routing"] == _compiled.EDITED
    assert not seen["decider"].endswith(".py"), "an unchanged module should still run compiled"
    assert seen["status"]["decider"] == _compiled.COMPILED


def test_the_build_compiles_an_edited_module_again_and_vouches_for_its_new_source(tmp_path: Path) -> None:
    """By digest, not by file times: the edited source is given its old time back, so that
    only its content says it changed."""
    built()
    tree = copy_of_the_tree(tmp_path)
    routing = tree / "coordinator/core/routing.py"
    times = routing.stat()
    with routing.open("a") as source:
        source.write("\nEDITED_AFTER_THE_BUILD = True\n")
    os.utime(routing, ns=(times.st_atime_ns, times.st_mtime_ns))
    decider = next((tree / "coordinator/core").glob("decider.*.so"))
    decider_built = decider.stat().st_mtime_ns

    done = build_in_place(tree)
    assert done.returncode == 0, done.stderr
    seen = run(PROBE, tree)

    assert seen["status"]["routing"] == _compiled.COMPILED, seen["status"]
    assert not seen["routing"].endswith(".py") and seen["edited"], "the build did not compile the edited source"
    assert decider.stat().st_mtime_ns == decider_built, "an unchanged module was compiled again"
    assert seen["status"]["decider"] == _compiled.COMPILED


def test_a_compile_that_fails_leaves_no_old_build_to_run(tmp_path: Path) -> None:
    """No C compiler (CC=false) for the one module to compile again: its old build is gone, not
    vouched for, and its edited source runs; the others keep their builds."""
    built()
    tree = copy_of_the_tree(tmp_path)
    with (tree / "coordinator/core/routing.py").open("a") as source:
        source.write("\nEDITED_AFTER_THE_BUILD = True\n")

    done = build_in_place(tree, CC="false")
    assert done.returncode == 0, done.stderr  # optional extensions: a failed compile is a warning
    seen = run(PROBE, tree)

    assert not list((tree / "coordinator/core").glob("routing.*.so")), "the stale build was left in place"
    assert seen["status"]["routing"] == _compiled.NOT_COMPILED
    assert seen["routing"].endswith("routing.py") and seen["edited"]
    assert seen["status"]["decider"] == _compiled.COMPILED
    assert "routing" not in json.loads((tree / "coordinator/core/_compiled.json").read_text())["modules"]


def test_a_module_cython_cannot_translate_runs_as_python(tmp_path: Path) -> None:
    """Python 3.11 that Cython 3 refuses (a starred subscript): the build goes on without it."""
    built()
    tree = copy_of_the_tree(tmp_path)
    with (tree / "coordinator/core/routing.py").open("a") as source:
        source.write("\nEDITED_AFTER_THE_BUILD = True\n\n\ndef _starred(a, b):\n    return a[*b]\n")

    done = build_in_place(tree)
    assert done.returncode == 0, done.stderr
    seen = run(PROBE, tree)

    assert "Cython could not translate" in done.stderr and "routing.py" in done.stderr
    assert seen["status"]["routing"] == _compiled.NOT_COMPILED
    assert seen["routing"].endswith("routing.py") and seen["edited"]
    assert seen["status"]["decider"] == _compiled.COMPILED


def test_the_build_compiles_everything_again_when_its_settings_change() -> None:
    """A build made by another Cython, other directives or another Python vouches for nothing."""
    setup = setup_script()
    digests = {"decider": "a" * 64, "routing": "b" * 64}
    now = setup.settings("3.3.1")
    manifest = {"settings": now, "modules": dict(digests)}

    assert setup.stale(digests, now, manifest) == set()
    assert setup.stale({**digests, "routing": "c" * 64}, now, manifest) == {"routing"}
    assert setup.stale(digests, setup.settings("3.2.0"), manifest) == {"decider", "routing"}
    assert setup.stale(digests, now, {}) == {"decider", "routing"}
    assert setup.stale(digests, now, {"settings": now, "modules": {"decider": "a" * 64}}) == {"routing"}
    assert "annotation_typing" in now and sys.version.split()[0] in now


def test_an_unreadable_manifest_vouches_for_nothing(tmp_path: Path) -> None:
    built()
    tree = copy_of_the_tree(tmp_path)
    (tree / "coordinator/core/_compiled.json").write_text('{"settings": "cython 3.3.1", "modu')

    seen = run(PROBE, tree)

    assert seen["status"] == dict.fromkeys(seen["status"], _compiled.UNVOUCHED)
    assert seen["routing"].endswith(".py") and seen["decider"].endswith(".py")


def test_a_build_whose_source_is_gone_is_not_imported_and_the_next_build_removes_it(tmp_path: Path) -> None:
    built()
    tree = copy_of_the_tree(tmp_path)
    (tree / "coordinator/core/routing.py").unlink()

    done = subprocess.run(
        [sys.executable, "-c", "import coordinator.core.routing"],
        cwd=tree,
        env=environ(tree),
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode != 0
    assert "ModuleNotFoundError: coordinator.core.routing: source gone" in done.stderr, done.stderr
    assert run(STATUS, tree)["routing"] == _compiled.ORPHANED

    assert build_in_place(tree).returncode == 0
    assert not list((tree / "coordinator/core").glob("routing.*.so")), "the build kept a build whose source is gone"
    assert "routing" not in run(STATUS, tree)


def test_a_build_no_digest_vouches_for_runs_from_its_source(tmp_path: Path) -> None:
    built()
    tree = copy_of_the_tree(tmp_path)
    (tree / "coordinator/core/_compiled.json").unlink()

    seen = run(PROBE, tree)

    assert seen["status"] == dict.fromkeys(seen["status"], _compiled.UNVOUCHED)
    assert seen["routing"].endswith(".py") and seen["decider"].endswith(".py")


def test_pure_python_runs_every_core_module_from_its_source() -> None:
    built()
    seen = run(PROBE, ROOT, **{_compiled.PURE_PYTHON: "1"})

    assert seen["routing"].endswith("routing.py") and seen["decider"].endswith("decider.py")
    assert seen["status"] == dict.fromkeys(seen["status"], _compiled.FORCED)


def test_the_compiled_core_decides_as_its_source() -> None:
    """The bundled Mooncake trace through both: the same hit blocks and the same end state."""
    built()
    compiled = run(REPLAY, ROOT)
    source = run(REPLAY, ROOT, **{_compiled.PURE_PYTHON: "1"})

    assert set(compiled["status"].values()) == {_compiled.COMPILED}
    assert set(source["status"].values()) == {_compiled.FORCED}
    assert compiled["hit"] == source["hit"] > 0
    assert compiled["digest"] == source["digest"]
