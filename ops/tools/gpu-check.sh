#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent CUDA machine (see README, "On a GPU").
#
# Runs from the repository root under that machine's own python3 (its torch with CUDA), with
# kvledger's other dependencies installed from wheels carried in .whl/ (cp312, fetched on a machine
# with a registry by `pip download`; see README). Writes its logs under $OUT (or ./gpu-check-out):
#   1. the machine: nvidia-smi, torch and its CUDA device;
#   2. tests/gpu with CUDA visible: the CUDA-only tests (I15 shift and swap on a cuda pool; a store
#      on the transfer stream reading what the compute stream wrote) run instead of skipping, and
#      every worker test runs its pools on the GPU;
#   3. ops/bench/copies.py --device cuda at 16 KiB and 256 KiB blocks.
set -u -o pipefail
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
py="${PYTHON:-python3}"

if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1

{ nvidia-smi -L; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'; } 2>&1 | tee "$out/machine.txt"

"$py" -m pytest tests/gpu/test_gpu_copies.py tests/gpu/test_gpu_worker.py -q -p no:cacheprovider -rs 2>&1 | tee "$out/tests.txt"
tests_rc=$?

for block in 16384 262144; do
    echo "== copies.py --device cuda --block-bytes $block"
    "$py" ops/bench/copies.py --device cuda --block-bytes "$block" 2>&1
done | tee "$out/copies.txt"

echo "gpu tests rc $tests_rc"
exit "$tests_rc"
