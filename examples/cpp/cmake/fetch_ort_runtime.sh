#!/bin/sh
# Downloads Debian's onnxruntime runtime package, the headers package and every package the runtime depends on
# (recursively: libc6, libstdc++6, oneDNN, XNNPACK, protobuf, ...) from one Debian suite into DEST, by name with
# `apt-get download`. Nothing is installed and no system file is touched: apt runs with private state and cache
# directories under DEST and the machine's own Debian archive entry (URI and keyring), with the suite swapped to
# SUITE -- the way cmake/fetch_ort_headers.sh fetches the headers for the library build. apt checks every file
# against the suite's signed index; the CMake side additionally pins the SHA-256 of the onnxruntime packages.
#
# usage: fetch_ort_runtime.sh DEST SUITE RUNTIME_PACKAGE=VERSION DEV_PACKAGE=VERSION
set -eu
dest=$1 suite=$2 runtime=$3 dev=$4
. "$(dirname "$0")/../../../cmake/debian_apt.sh"
work="$dest/apt"
# an empty dpkg status (set before the update): resolve the whole closure, not what this machine has installed
: >"$dest/apt-status"
debian_apt_setup "$work" "$suite"
opts="$opts -o Dir::State::Status=$dest/apt-status"
# apt-get update exits 0 when it could not reach the archive (it only warns): check that the index holds the package.
for p in "$runtime" "$dev"; do
  # shellcheck disable=SC2086
  apt-cache $opts show "$p" >/dev/null 2>&1 || {
    echo "$p is not in the package index of suite $suite at $uri; apt-get update said:" >&2
    grep -E '^(W|E|Err):' "$work/update.log" | head -5 >&2
    exit 4
  }
done
# Real packages of the dependency closure (virtual names print as <name>; their providers are listed too).
# shellcheck disable=SC2086
closure=$(apt-cache $opts depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
  --no-enhances "${runtime%%=*}" 2>"$work/depends.log" | grep -E '^[a-z0-9]' | grep -vx "${runtime%%=*}" | sort -u) \
  || { cat "$work/depends.log" >&2; exit 5; }
[ -n "$closure" ] || { echo "apt-cache found no dependencies of ${runtime%%=*}" >&2; exit 5; }
# shellcheck disable=SC2086
(cd "$dest" && apt-get -q $opts download "$runtime" "$dev" $closure) >"$work/download.log" 2>&1 \
  || { cat "$work/download.log" >&2; exit 6; }
rm -rf "$work" "$dest/apt-status"
