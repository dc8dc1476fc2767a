#!/usr/bin/env bash
# ckptio-bench runs end to end on a tiny size and writes the JSON fields
# docs/PERFORMANCE.md describes (a functional check, not a timing).
set -euo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin/ckptio-bench" --dir "$tmp/data" --size 2 --repeat 1 --json "$tmp/out.json" >"$tmp/log" 2>&1 ||
  { cat "$tmp/log"; echo "FAIL: ckptio-bench failed"; exit 1; }
/usr/bin/python3 - "$tmp/out.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
need = ["save_vs_raw_write", "load_vs_torch_load", "load_vs_raw_read", "save_vs_torch_save",
        "async_stall_vs_sync_save", "small_tensors_save_vs_raw_write", "save_vs_python_save",
        "load_vs_python_load"]
missing = [k for k in need if k not in d["ratios"]]
assert not missing, "missing ratios: %s" % missing
for shape in ("large", "small"):
    s = d["shapes"][shape]["seconds"]
    for k in ("raw_write", "ckptio_save", "torch_save", "python_save", "raw_read",
              "ckptio_load", "torch_load", "python_load", "raw_read_cold", "ckptio_load_cold"):
        assert s[k] > 0, (shape, k)
assert d["machine"]["cores"] >= 1
print("bench smoke: %d ratios, every contender timed for both shapes" % len(d["ratios"]))
PY
