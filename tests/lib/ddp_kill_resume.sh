# The DDP demo killed and resumed over a remote store: shared by
# plugins/nfs/tests/ddp_nfs_test.sh and plugins/s3/tests/ddp_s3_test.sh.
# Source it with $bin (the build's bin folder), $tmp (a scratch folder) and
# $label ("nfs", "s3") set; then call reference_run once, and
# kill_and_resume for each store.

hash_of() { sed -n 's/^final parameter hash: //p' "$1"; }
demo() { "$bin/ckptio-launch" -n 4 --grace 30 -- "$bin/ckptio-ddp-demo" --steps 40 --every 10 "$@"; }
fail() {
  cat "$tmp/log"
  echo "FAIL: $*"
  exit 1
}

# Sets $clean: the final parameter hash of an uninterrupted run on local disk.
reference_run() {
  demo --store "$tmp/local" >"$tmp/log" 2>&1 || fail "the local reference run"
  clean=$(hash_of "$tmp/log")
}

# kill_and_resume NAME URI WAIT EXPECTED_WAITER_ERROR TIMEOUT: rank 0
# SIGKILLed while it writes step 20; every waiter must report
# EXPECTED_WAITER_ERROR (a regular expression); the relaunch must resume
# from step 10 and end with $clean, and the store must verify and be clean.
kill_and_resume() {
  local name=$1 uri=$2 wait=$3 expect=$4 timeout=$5
  set +e
  demo --store "$uri" --wait "$wait" --timeout "$timeout" --kill-rank0-during-save=20 >"$tmp/log" 2>&1
  local rc=$?
  set -e
  [ "$rc" != 0 ] || fail "$name: the killed run exited 0"
  grep -q "rank 0 killed by signal 9" "$tmp/log" || fail "$name: rank 0 was not killed"
  local n
  n=$(grep -c "$expect" "$tmp/log" || true)
  [ "$n" = 3 ] || fail "$name: $n of 3 waiters reported \"$expect\""
  demo --store "$uri" --wait "$wait" --timeout 30 >"$tmp/log" 2>&1 || fail "$name: the relaunch"
  grep -q "resumed from step 10" "$tmp/log" || fail "$name: did not resume from step 10"
  [ "$(hash_of "$tmp/log")" = "$clean" ] || fail "$name: final hash differs from the local run"
  "$bin/ckptio" verify "$uri" --all >"$tmp/log" 2>&1 || fail "$name: ckptio verify"
  "$bin/ckptio" fsck "$uri" >"$tmp/log" 2>&1 || fail "$name: ckptio fsck"
  echo "ddp over $label ($name): rank 0 killed at step 20, waiters: $expect; resumed from 10;" \
    "final hash = local run"
}
