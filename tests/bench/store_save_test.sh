#!/usr/bin/env bash
# ckptio-bench's checksum pair (tools/bench/store_save.cc): ckptio-bench-save
# writes a store that `ckptio verify` accepts; ckptio-bench-save-unhashed,
# the same save with a hasher that does no work, writes the same objects
# (sizes, chunks), a valid manifest and LATEST, and data that fails
# verification (DATA_LOSS) in every object: it hashed nothing, so its time
# is that of a save without checksums.
set -euo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# 3 buffers of 3 MiB + 5 bytes: 3 chunks of 4 MiB, writes overlapped with hashing.
count=3 bytes=$(((3 << 20) + 5))
for prog in ckptio-bench-save ckptio-bench-save-unhashed; do
  secs=$("$bin/$prog" "$tmp/$prog" $count $bytes) || { echo "FAIL: $prog failed"; exit 1; }
  /usr/bin/python3 -c 'import sys; assert float(sys.argv[1]) > 0, sys.argv' "$secs"
  "$bin/ckptio" inspect --json "$tmp/$prog" 1 >"$tmp/$prog.inspect"
  rc=0
  "$bin/ckptio" verify --json "$tmp/$prog" >"$tmp/$prog.verify" 2>"$tmp/$prog.err" || rc=$?
  echo "$rc" >"$tmp/$prog.rc"
done
! "$bin/ckptio-bench-save" "$tmp/x" 0 1 2>/dev/null || { echo "FAIL: COUNT 0 accepted"; exit 1; }
/usr/bin/python3 - "$tmp" $count $bytes <<'PY'
import json, sys
tmp, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(prog, what):
    return json.load(open("%s/%s.%s" % (tmp, prog, what)))
def rc(prog):
    return int(open("%s/%s.rc" % (tmp, prog)).read())
for prog in ("ckptio-bench-save", "ckptio-bench-save-unhashed"):
    objects = load(prog, "inspect")["objects"]
    assert [(o["name"], o["size"], o["chunks"]) for o in objects] == [
        ("tensors", count * size, 3)], (prog, objects)
hashed = load("ckptio-bench-save", "verify")
assert rc("ckptio-bench-save") == 0 and hashed["ok"], hashed
unhashed = load("ckptio-bench-save-unhashed", "verify")
assert rc("ckptio-bench-save-unhashed") == 1 and not unhashed["ok"], unhashed
assert "latest_error" not in unhashed, unhashed  # LATEST and the manifest check out
[step] = unhashed["steps"]
assert step["corrupt"] and step["errors"], step
for e in step["errors"]:  # the objects' data, and only that, fails
    assert e.startswith("DATA_LOSS") and "tensors" in e, e
print("store save pair: hashed verifies, unhashed fails with %s" % step["errors"][0][:100])
PY
