#!/usr/bin/env bash
# The growth table of docs/PERFORMANCE.md: save, async stall, verify, load
# and cold load, and the memory a save and a load take, at each state size
# and tensor count, one fresh process (ckptio-bench-growth) per row. Builds
# ckptio first (tools/setup.sh), then prints the table in Markdown.
#
#   tools/bench/growth.sh [--dir DIR] [--repeat N] [--sizes "MiB ..."] [--tensors "N ..."]
#
# Defaults: --dir ./growth-data, --repeat 3, --sizes "64 256 1024 4096 16384",
# --tensors "1 100 10000 100000" (4 KiB each). A size that does not fit in
# memory (the state, and its staging copy up to 4 GiB) or on the folder's
# disk (two steps) stops the script with what is missing. Each row's JSON
# goes to DIR/growth-*.json. CKPTIO_BIN=DIR: use the binaries in DIR, no build.
set -euo pipefail

dir=./growth-data repeat=3 sizes="64 256 1024 4096 16384" tensors="1 100 10000 100000"
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --tensors) tensors=$2; shift 2 ;;
    *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done

if [ -n "${CKPTIO_BIN:-}" ]; then  # binaries built already (the tests)
  CKPTIO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  growth=$CKPTIO_BIN/ckptio-bench-growth
else
  source "$(dirname "${BASH_SOURCE[0]}")/../setup.sh" >&2
  growth=$BUILD_DIR/bin/ckptio-bench-growth
fi
mkdir -p "$dir"
commit=$(git -C "$CKPTIO_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git -C "$CKPTIO_ROOT" status --porcelain -uno 2>/dev/null)" ] || commit="$commit-dirty"

rows=()
run() {  # run KIND VALUE: one row, its details on stderr
  local out
  out=$("$growth" --dir "$dir" "--$1" "$2" --repeat "$repeat" --row \
    --json "$dir/growth-$1-$2.json")
  echo "$out" | grep -v '^ROW ' >&2
  rows+=("$(echo "$out" | sed -n 's/^ROW //p')")
}
for s in $sizes; do run size "$s"; done
for n in $tensors; do run tensors "$n"; done

echo
echo "ckptio-bench-growth at $commit, --repeat $repeat, $(nproc) cores, $(df -T "$dir" | awk 'NR==2 {print $2}') at $dir"
echo "(medians; memory: save's peak beyond the state / load's peak / private memory a load left, MiB)"
echo
echo "| state | tensors | save | async stall | verify (warm) | load (warm) | load (cold) | memory |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
