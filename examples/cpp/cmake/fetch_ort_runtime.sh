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
command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: this is not a Debian-like system" >&2; exit 3; }

work="$dest/apt"
rm -rf "$work"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/sources.d"

# The first Debian archive entry (not the security archive) of this machine's apt sources, as URI + keyring
# (the same discovery as cmake/fetch_ort_headers.sh).
uri="" keyring=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  eval "$(awk 'BEGIN{RS=""; FS="\n"} {
      u=""; k=""; s="";
      for (i = 1; i <= NF; i++) {
        if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/, "", $i); split($i, a, " "); u = a[1] }
        if ($i ~ /^Signed-By:/) { sub(/^Signed-By:[ \t]*/, "", $i); k = $i }
        if ($i ~ /^Suites:/) { s = $i }
      }
      if (u != "" && s !~ /-security/ && u !~ /security/) { printf "uri=%s keyring=%s\n", u, k; exit }
    }' "$f")"
  [ -n "$uri" ] && break
done
if [ -z "$uri" ]; then
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { if ($i !~ /security/) { print $i; exit } } }' "$f")
    [ -n "$uri" ] && break
  done
fi
[ -n "$uri" ] || { echo "no Debian archive found in /etc/apt sources" >&2; exit 3; }
[ -n "$keyring" ] || keyring=/usr/share/keyrings/debian-archive-keyring.gpg

cat >"$work/sources.d/runtime.sources" <<SRC
Types: deb
URIs: $uri
Suites: $suite
Components: main
Signed-By: $keyring
SRC

opts="-o Dir::Etc::SourceList=$work/none.list -o Dir::Etc::SourceParts=$work/sources.d \
 -o Dir::State::Lists=$work/lists -o Dir::Cache=$work/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=root \
 -o Dir::State::Status=$work/status"
: >"$work/status"  # an empty dpkg status: resolve the whole closure, not what this machine has installed
# shellcheck disable=SC2086
apt-get -q $opts update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 4; }
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
rm -rf "$work"
