#!/usr/bin/env bash
# Regenerates docs/RELIABILITY.md from the tests' own output: runs the
# crash, fault, corruption, coordination and fuzzing tests of ./build and
# copies the summary lines they print. Usage: tools/reliability.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh" >/dev/null
bin=$BUILD_DIR/bin
out=$CKPTIO_ROOT/docs/RELIABILITY.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

lines() {  # lines() PATTERN COMMAND...: run, keep the summary lines
  local pattern=$1
  shift
  "$@" >"$tmp/log" 2>&1 || { cat "$tmp/log"; echo "reliability: $* failed" >&2; exit 1; }
  grep -E "$pattern" "$tmp/log" | sed 's/^/    /'
}

hostile=$("$bin/manifest_test" --gtest_list_tests | grep -c '^  RejectedWithPreciseError/')
{
  cat <<'HEAD'
# Reliability evidence

Every number below was printed by a test of this repository in one run of
`tools/reliability.sh`, which regenerates this page (the same tests run in
`tools/test.sh` and CI). What each scenario does and what it proves is in
the test named with it; the invariants are those of [DESIGN.md](DESIGN.md).

HEAD
  echo "Generated $(date -u +%Y-%m-%dT%H:%MZ) at commit $(git -C "$CKPTIO_ROOT" rev-parse --short HEAD) on $(nproc) cores."
  echo
  echo "## Crashes and I/O errors during a save, its retention, gc and repair"
  echo
  echo 'Test: `plugins/faulty/tests/fault_sweep_test.cc` (`build/bin/fault_sweep_test`). After'
  echo 'every case a fresh view of the store must hold the old or the new checkpoint,'
  echo 'verifying byte for byte; LATEST must name a committed step; `fsck --repair` must'
  echo 'end clean without losing a good step; gc and retention must leave no step'
  echo 'half-deleted (every step that has a manifest still verifies); the next save must work.'
  echo
  lines '^(crash sweep|error sweep|sigkill|gc sweep):' "$bin/fault_sweep_test" --gtest_filter=-*PowerLoss*
  echo
  echo "## Power loss during a save, its retention, gc and repair"
  echo
  echo 'Test: the same file. The POSIX backend runs on `PowerLossFs`'
  echo '(`plugins/faulty/include/ckptio/power_loss_fs.h`), which tracks what each fsync made'
  echo 'durable and cuts the power at system call k; then either every unsynced directory'
  echo 'change is undone and unsynced file bytes dropped ("drop"), or each unsynced change'
  echo 'is kept or undone at random and unsynced tails partly kept with junk ("garble"),'
  echo 'the LevelDB/RocksDB fault-injection model. Every k of each operation, both modes,'
  echo 'plus a cut right after the operation returned: the same invariants as above, and a'
  echo 'save that returned OK must survive; the striped save has a second rank commit its'
  echo 'objects into the step and hand the writer a receipt. `tests/torch/torch_power_loss_test.cc`'
  echo 'does the same for a LibTorch save (module, Adam, tensor) and loads the result bit-exactly.'
  echo
  lines '^power-loss sweep' "$bin/fault_sweep_test" --gtest_filter=*PowerLoss*
  lines '^torch power loss' "$bin/torch_power_loss_test"
  echo
  echo "## Corruption"
  echo
  echo 'Tests: `tests/corruption_test.cc`, `tests/torch/torch_corruption_test.cc`, `tests/cli_test.cc`.'
  echo 'Every damaged byte is detected by the reading API (which then returns zeros,'
  echo 'never the bad bytes), `ckptio verify` exits 1 naming the object and byte range,'
  echo 'and `Checkpointer::Load` falls back to the previous good step.'
  echo
  lines '^corruption:' "$bin/corruption_test"
  CKPTIO_BIN_DIR=$bin lines '^torch corruption:' "$bin/torch_corruption_test"
  echo
  echo "## Hostile input"
  echo
  echo "    manifest_test: $hostile hostile manifests and LATEST files (truncated, wrong types, traversal names, duplicates, huge sizes, missing fields, unknown versions, bad checksums), each a precise error"
  lines '^safetensors:' "$bin/safetensors_test"
  echo
  echo "## Ranks: commits, deaths and agreement (real processes)"
  echo
  echo 'Tests: `tests/coordination_*_test.cc` (core), `tests/torch/torch_ranks_*_test.cc`'
  echo '(Checkpointer with 4 ranks, plain and striped saves), `tests/ddp/kill_resume_test.sh`'
  echo '(the DDP demo).'
  echo
  lines '^coordination' "$bin/coordination_test"
  lines '^(torch-ranks|random kills)' "$bin/torch_ranks_test"
  lines '^ddp demo' "$CKPTIO_ROOT/tests/ddp/kill_resume_test.sh" "$bin"
  echo
  echo "## An object store: s3:// on a real Ceph RGW"
  echo
  echo 'Test: `plugins/s3/tests/s3_store_test.cc` (`build/bin/s3_store_test`, which starts a'
  echo 'throw-away Ceph with `tools/rgw-server.sh`; skipped where Ceph is not installed), and'
  echo 'servers scripted to hang, lie or refuse. Every call ends by its deadline; a torn save'
  echo 'is never visible; a lease is taken over only once it expired by the server'"'"'s clock.'
  echo
  if [ -x "$bin/s3_store_test" ]; then
    lines '^s3' "$bin/s3_store_test"
  else
    echo "    (not built: configure with -DCKPTIO_WITH_S3=ON)"
  fi
  echo
  echo "## Fuzzing"
  echo
  echo 'libFuzzer with ASan and UBSan (`tools/fuzz.sh`, seed corpus in `tests/fuzz/corpus`).'
  echo
  CKPTIO_FUZZ_SECONDS=${CKPTIO_FUZZ_SECONDS:-15} lines '^fuzz ' "$CKPTIO_ROOT/tools/fuzz.sh"
  echo
  cat <<'TAIL'
## Reproduce

    ./tools/test.sh                       # everything, release and ASan+UBSan builds, fuzzing
    ./tools/reliability.sh                # this page
    build/bin/fault_sweep_test            # one scenario at a time

Sanitizers: AddressSanitizer and UndefinedBehaviorSanitizer run the whole
suite (but the Python package's tests, the documentation's compiled
examples, the DDP demo's whole runs and the timed benchmarks);
ThreadSanitizer runs the lock and coordination tests (store, writer lock,
coordination, POSIX backend conformance with threads, and the NFS lock
tests: v4 renewals and releases, v3 leases).

## Limits of the model

- Power loss is simulated above the kernel (`PowerLossFs`), after the model
  of LevelDB and RocksDB; it relies on fsync doing what POSIX says. Disks
  that lie about flushes, and file systems mounted without barriers, are
  outside what software can prove.
TAIL
} >"$tmp/page"
mv "$tmp/page" "$out"
echo "reliability: wrote $out"
