#!/bin/sh
# Install a Mooncake Store (the master and the Python client) under .tools/mooncake, for the
# Mooncake tier's tests (tests/gpu/test_mooncake_tier.py) and ops/bench/tiers.py.
#
# Mooncake's PyPI wheel (mooncake-transfer-engine) links RDMA and CUDA libraries even for its TCP
# transport, so beside the wheel this puts, all under .tools/mooncake and nothing system-wide:
#   site/   the wheel and nvidia-cuda-runtime-cu12 (libcudart.so.12), `pip install --target`;
#   debs/   libibverbs1, ibverbs-providers, libnl-3-200, libnl-route-3-200 from Debian
#           (`apt-get download`, unpacked with `dpkg -x`: no maintainer script runs);
#   stub/   libcuda.so.1 built from ops/tools/libcuda_stub.c with the system C compiler, unless
#           the machine has a real driver (ldconfig knows libcuda.so.1).
# gpu.mooncake.load_store() loads these for the process that imports the client, and
# `mooncake_env` (printed at the end) is what the master needs on LD_LIBRARY_PATH. Idempotent:
# an install whose client and master start is kept.
#
#   sh ops/tools/install-mooncake.sh [PYTHON]     # -> .tools/mooncake
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
tools=${KVLEDGER_TOOLS:-$root/.tools}
dest=$tools/mooncake
python=${1:-$root/.venv/bin/python}
wheel="mooncake-transfer-engine==0.3.13.post1"
cudart="nvidia-cuda-runtime-cu12==12.9.79"

check() {
    [ -f "$1/ready" ] && KVLEDGER_MOONCAKE_HOME="$1" "$python" -c "from gpu.mooncake import load_store; load_store()" >/dev/null 2>&1
}

if check "$dest"; then
    echo "mooncake already installed: $dest"
    exit 0
fi
for tool in apt-get dpkg; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install-mooncake: needs $tool (a Debian or Ubuntu machine)" >&2
        exit 1
    fi
done

rm -rf "$dest.partial"
mkdir -p "$dest.partial/debs" "$dest.partial/stub"
"$python" -m pip install --quiet --disable-pip-version-check --target "$dest.partial/site" "$wheel" "$cudart"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
chmod 0777 "$scratch"  # with root, apt drops to the _apt user for the download
if ! (cd "$scratch" && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 >"$scratch/apt.log" 2>&1); then
    cat "$scratch/apt.log" >&2
    echo "install-mooncake: 'apt-get download' of the RDMA libraries failed (no package lists? run apt-get update)" >&2
    exit 1
fi
for deb in "$scratch"/*.deb; do
    dpkg -x "$deb" "$dest.partial/debs"
done

if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    cc=${CC:-cc}
    if ! command -v "$cc" >/dev/null 2>&1; then
        echo "install-mooncake: no NVIDIA driver and no C compiler ($cc) to build the libcuda.so.1 stub" >&2
        exit 1
    fi
    "$cc" -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$dest.partial/stub/libcuda.so.1" "$root/ops/tools/libcuda_stub.c"
fi

touch "$dest.partial/ready"
if ! check "$dest.partial"; then
    KVLEDGER_MOONCAKE_HOME="$dest.partial" "$python" -c "from gpu.mooncake import load_store; load_store()" >&2 || true
    echo "install-mooncake: the Mooncake client does not load from $dest.partial" >&2
    exit 1
fi
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "mooncake installed: $dest"
