#!/bin/sh
# Install promtool (from Debian's `prometheus` package) under .tools/prometheus, for
# tests/ops/test_ops.py (`promtool check rules`, `promtool test rules` on ops/alerts/).
#
# It never starts a Prometheus server and needs no root: `apt-get download` fetches the .deb into
# a scratch directory and `dpkg -x` unpacks it there (no maintainer scripts run, no service is
# enabled, nothing is registered with dpkg). Idempotent: a working promtool already there is kept.
# It needs apt's package lists (`apt-get update`, done by whoever set up the machine); without
# them it says so and exits 1.
#
#   sh ops/tools/install-promtool.sh            # -> .tools/prometheus/usr/bin/promtool
#   KVLEDGER_TOOLS=/elsewhere sh ops/tools/install-promtool.sh
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
tools=${KVLEDGER_TOOLS:-$root/.tools}
dest=$tools/prometheus
promtool=$dest/usr/bin/promtool

if [ -x "$promtool" ] && "$promtool" --version >/dev/null 2>&1; then
    echo "promtool already installed: $promtool"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "install-promtool: needs apt-get and dpkg (a Debian or Ubuntu machine); or put promtool on PATH" >&2
    exit 1
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# apt-get download writes into the current directory as the calling user; with root, apt drops
# to the _apt user for the download, which must be able to write there.
chmod 0777 "$scratch"
if ! (cd "$scratch" && apt-get download prometheus >"$scratch/apt.log" 2>&1); then
    cat "$scratch/apt.log" >&2
    echo "install-promtool: 'apt-get download prometheus' failed (no package lists? run apt-get update)" >&2
    exit 1
fi
deb=$(ls "$scratch"/prometheus_*.deb)
rm -rf "$dest.partial"
mkdir -p "$dest.partial"
dpkg -x "$deb" "$dest.partial"
"$dest.partial/usr/bin/promtool" --version >/dev/null
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "promtool installed: $promtool ($("$promtool" --version 2>&1 | head -n 1))"
