#!/bin/sh
# Downloads one Debian binary package by name and version into DEST, using the machine's own apt configuration
# with the suite swapped to SUITE (the package only exists from Debian 13 on). Nothing is installed and no system
# file is touched: apt runs with private state/cache directories under DEST.
#
# usage: fetch_ort_headers.sh DEST PACKAGE VERSION SUITE
set -eu
dest=$1 pkg=$2 ver=$3 suite=$4
command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: this is not a Debian-like system" >&2; exit 3; }

work="$dest/apt"
rm -rf "$work"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/sources.d"

# The first Debian archive entry (not the security archive) of this machine's apt sources, as URI + keyring.
uri="" keyring=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  # deb822 stanzas: pick the first whose Suites line has no "-security".
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

cat >"$work/sources.d/headers.sources" <<SRC
Types: deb
URIs: $uri
Suites: $suite
Components: main
Signed-By: $keyring
SRC

opts="-o Dir::Etc::SourceList=$work/none.list -o Dir::Etc::SourceParts=$work/sources.d \
 -o Dir::State::Lists=$work/lists -o Dir::Cache=$work/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=root"
# shellcheck disable=SC2086
apt-get -q $opts update >"$work/update.log" 2>&1 || { cat "$work/update.log" >&2; exit 4; }
# shellcheck disable=SC2086
(cd "$dest" && apt-get -q $opts download "$pkg=$ver") >"$work/download.log" 2>&1 || { cat "$work/download.log" >&2; exit 5; }
rm -rf "$work"
