# Sourced (POSIX sh) by the scripts that download Debian packages by name: cmake/fetch_ort_headers.sh (the headers
# of the library build) and examples/cpp/cmake/fetch_ort_runtime.sh (the C++ example's onnxruntime).
#
# debian_apt_setup WORK SUITE
#   Prepares a private apt under WORK (state, lists, cache and one sources entry; nothing is installed and no system
#   file is touched) pointing at this machine's own Debian archive entry (its first non-security URI and keyring,
#   from deb822 .sources or one-line .list files) with the suite swapped to SUITE. Sets `uri` and `opts` (the -o
#   options every apt-get / apt-cache call of the caller passes) and runs `apt-get update` (log in WORK/update.log).
#   Exits 3 when this is not a Debian-like system or no archive is configured, 4 when the update fails.
debian_apt_setup() {
  _work=$1 _suite=$2
  command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: this is not a Debian-like system" >&2; exit 3; }
  rm -rf "$_work"
  mkdir -p "$_work/lists/partial" "$_work/cache/archives/partial" "$_work/sources.d"
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
  cat >"$_work/sources.d/debian.sources" <<SRC
Types: deb
URIs: $uri
Suites: $_suite
Components: main
Signed-By: $keyring
SRC
  opts="-o Dir::Etc::SourceList=$_work/none.list -o Dir::Etc::SourceParts=$_work/sources.d \
 -o Dir::State::Lists=$_work/lists -o Dir::Cache=$_work/cache -o Debug::NoLocking=1 -o APT::Sandbox::User=root"
  # shellcheck disable=SC2086
  apt-get -q $opts update >"$_work/update.log" 2>&1 || { cat "$_work/update.log" >&2; exit 4; }
}
