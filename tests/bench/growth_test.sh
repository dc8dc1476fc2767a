#!/usr/bin/env bash
# ckptio-bench-growth and tools/bench/growth.sh end to end on small states
# (functional, not timed), and the memory invariants the growth table
# reports: a save takes no copy of the state, a load maps it once.
set -euo pipefail
bin=$1
src=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { cat "$tmp/log" 2>/dev/null; echo "FAIL: $*"; exit 1; }

"$bin/ckptio-bench-growth" --dir "$tmp/data" --size 64 --repeat 2 --json "$tmp/size.json" \
  >"$tmp/log" 2>&1 || fail "ckptio-bench-growth --size 64"
"$bin/ckptio-bench-growth" --dir "$tmp/data" --tensors 100 --repeat 1 --json "$tmp/tensors.json" \
  >"$tmp/log" 2>&1 || fail "ckptio-bench-growth --tensors 100"
/usr/bin/python3 - "$tmp/size.json" "$tmp/tensors.json" <<'PY'
import json, sys
MiB = 1 << 20
for path, state, count in ((sys.argv[1], 64 * MiB, 8), (sys.argv[2], 100 * 4096, 100)):
    d = json.load(open(path))
    assert d["state_bytes"] == state and d["tensors"] == count, d
    for k in ("save", "async_stall", "verify", "load", "load_cold"):
        assert 0 < d[k]["min"] <= d[k]["seconds"] <= d[k]["max"], (path, k, d[k])
    assert d["async_synchronous"] is False
    # The tensors' pages are the map's: a load's peak counts the state once
    # (a second copy of the 64 MiB state would make it 128 MiB; the slack is
    # what a sanitizer's allocator keeps: 80.1 MiB under ASan+UBSan at -O1).
    assert state // 2 <= d["load_peak_extra_bytes"] <= state + 32 * MiB, d
big = json.load(open(sys.argv[1]))
# 64 MiB of state: a save that staged a copy, or a load that copied the map
# into memory of its own, would add 64 MiB here.
assert big["save_peak_extra_bytes"] < 16 * MiB, big
assert big["load_anon_extra_bytes"] < 16 * MiB, big
print("growth: save peak +%.1f MiB, load peak %.1f MiB for 64 MiB of state" % (
    big["save_peak_extra_bytes"] / MiB, big["load_peak_extra_bytes"] / MiB))
PY

# A state that cannot fit is refused with what to do, before anything is made.
if "$bin/ckptio-bench-growth" --dir "$tmp/data" --size 1048576 >"$tmp/log" 2>&1; then
  fail "a 1 TiB state was not refused"
fi
grep -q "pick a smaller --size" "$tmp/log" || fail "the refusal does not say what to do"

# So is a state the disk cannot hold (a 32 MiB tmpfs: two steps of 64 MiB
# and a GiB to spare do not fit), before anything is written there.
if [ "$(id -u)" = 0 ] && mkdir -p "$tmp/small" &&
  mount -t tmpfs -o size=32m ckptio-growth-test "$tmp/small" 2>/dev/null; then
  trap 'umount "$tmp/small" 2>/dev/null || true; rm -rf "$tmp"' EXIT
  if "$bin/ckptio-bench-growth" --dir "$tmp/small/data" --size 64 >"$tmp/log" 2>&1; then
    fail "a state too large for the disk was not refused"
  fi
  grep -q "MiB free; two steps of 64.0 MiB and 1 GiB to spare are needed: pick a smaller --size or another --dir" \
    "$tmp/log" || fail "the disk refusal does not say what is missing and what to do"
  [ -z "$(ls -A "$tmp/small/data")" ] || fail "something was written before the refusal"
  umount "$tmp/small"
  echo "growth: a state too large for the disk was refused before anything was written"
else
  echo "growth: the refusal for too little disk NOT checked (needs root to mount a 32 MiB tmpfs)"
fi

# The script: a header and one row per size and tensor count.
CKPTIO_BIN=$bin "$src/tools/bench/growth.sh" --dir "$tmp/script" --repeat 1 --sizes "8 16" \
  --tensors "10" >"$tmp/table" 2>"$tmp/log" || fail "growth.sh"
grep -q '^| state | tensors | save |' "$tmp/table" || { cat "$tmp/table"; fail "no header"; }
rows=$(grep -c "^| [0-9.]* [KM]iB |" "$tmp/table") || true
[ "$rows" = 3 ] || { cat "$tmp/table"; fail "$rows rows, want 3"; }
echo "growth: the script printed the table with $rows rows"
