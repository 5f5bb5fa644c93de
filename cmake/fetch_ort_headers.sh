#!/bin/sh
# Downloads one Debian binary package by name and version into DEST, using the machine's own apt configuration
# with the suite swapped to SUITE (the package only exists from Debian 13 on). Nothing is installed and no system
# file is touched: apt runs with private state/cache directories under DEST.
#
# usage: fetch_ort_headers.sh DEST PACKAGE VERSION SUITE
set -eu
dest=$1 pkg=$2 ver=$3 suite=$4
. "$(dirname "$0")/debian_apt.sh"
work="$dest/apt"
debian_apt_setup "$work" "$suite"
# shellcheck disable=SC2086
(cd "$dest" && apt-get -q $opts download "$pkg=$ver") >"$work/download.log" 2>&1 || { cat "$work/download.log" >&2; exit 5; }
rm -rf "$work"
