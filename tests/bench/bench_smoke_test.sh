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
        "load_vs_python_load", "async_stall_vs_memcpy", "module_load_vs_raw_read",
        "striped_save_vs_rank0_save_4ranks", "load_vs_torch_load_cold", "load_vs_python_load_cold"]
missing = [k for k in need if k not in d["ratios"]]
assert not missing, "missing ratios: %s" % missing
for shape in ("large", "small"):
    s = d["shapes"][shape]["seconds"]
    for k in ("raw_write", "ckptio_save", "torch_save", "python_save", "raw_read",
              "ckptio_load", "torch_load", "python_load", "raw_read_cold", "ckptio_load_cold",
              "torch_load_cold", "python_load_cold"):
        assert s[k] > 0, (shape, k)
large = d["shapes"]["large"]["seconds"]
for k in ("ckptio_load_module", "memcpy", "ckptio_save_async_stall", "ckptio_save_4ranks",
          "ckptio_save_striped_4ranks"):
    assert large[k] > 0, k
assert all(v is not None and v > 0 for v in d["ratios"].values()), d["ratios"]
assert large["ckptio_save_hashed"] > 0 and large["ckptio_save_unhashed"] > 0
assert -1 < d["checksum_share_of_save"] < 1, d["checksum_share_of_save"]
# The commit, or null where the source is not a git checkout (the trixie chroot's copy).
assert "commit" in d and (d["commit"] is None or d["commit"]), d.get("commit")
if "ckptio_save_hashed_tmpfs" in large:  # where /dev/shm has room
    assert large["ckptio_save_unhashed_tmpfs"] > 0
    assert -1 < d["checksum_share_of_save_tmpfs"] < 1, d["checksum_share_of_save_tmpfs"]
assert d["machine"]["cores"] >= 1
print("bench smoke: %d ratios, every contender timed for both shapes" % len(d["ratios"]))
PY
