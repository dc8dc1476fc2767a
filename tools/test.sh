#!/usr/bin/env bash
# Builds ckptio (installing missing Debian packages) and runs the whole test
# suite with ctest: first the normal build (./build), then the same tests
# built with AddressSanitizer + UndefinedBehaviorSanitizer (./build-asan).
# Then the lock and coordination tests (NFS locks too) under ThreadSanitizer
# (./build-tsan), the tests that touch LibTorch built against LibTorch 2.6 in a
# Debian trixie chroot (tools/torch2-check.sh; root only, made once and kept),
# and the libFuzzer targets (tools/fuzz.sh) for a bounded time each.
# Set CKPTIO_SANITIZERS=0 to skip the sanitizer pass, CKPTIO_TORCH2=0 to skip
# the LibTorch 2.x pass and CKPTIO_FUZZ=0 to skip fuzzing. Extra arguments go to
# ctest (e.g. -R Manifest; the NFS lock pass under TSan then does not run).
# The last line is the summary:
#   "ctest: N passed, N failed, N skipped"
# after a "failed tests:" list naming each failure and its pass, if any.
set -euo pipefail

passed=0 failed=0 skipped=0 status=0 summarized=0 filtered=$#
failures="" # "pass: test" lines, repeated above the summary
log=$(mktemp)
# The summary is the last line even when a build stops the script early
# (set -e): the stop counts as one more failure.
on_exit() {
  local rc=$?
  rm -f "$log"
  if [ "$summarized" = 0 ]; then
    list_failures
    echo "test.sh: stopped early (exit $rc), most likely a build failed: see above"
    echo "ctest: $passed passed, $((failed + 1)) failed, $skipped skipped"
  fi
}
# list_failures: every failed test of every pass, so that the end of the output
# (all a CI log's tail may show) names them.
list_failures() {
  [ -n "$failures" ] || return 0
  echo "failed tests:"
  printf '%s' "$failures"
}
trap on_exit EXIT
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

# run_suite DIR LABEL [CTEST_ARGS...]: two tests a core at a time, as most
# wait on other processes, sockets and deadlines (one a core kept two cores
# 1.4 busy on average).
run_suite() {
  local dir=$1 label=$2
  shift 2
  echo "== test suite: $label ($dir)"
  set +e
  ctest --test-dir "$dir" --output-on-failure -j"$(($(nproc) * 2))" --timeout 600 "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  count "$label" "$rc"
}

# count LABEL RC: adds the ctest summary in $log (exit status RC) to the totals.
count() {
  local label=$1 rc=$2
  local summary
  # A filter (extra ctest arguments) may match no test of one pass; without
  # one, no tests means a broken build or label: a failure.
  if [ "$filtered" -gt 0 ] && grep -q "No tests were found" "$log"; then return; fi
  summary=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1 || true)
  if [ -z "$summary" ]; then
    echo "$label: ctest printed no summary (exit $rc)"
    failures+="  $label: ctest printed no summary (exit $rc)"$'\n'
    status=1
    failed=$((failed + 1))
    return
  fi
  local f t s
  f=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$summary")
  t=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$summary")
  s=$(grep -c '(Skipped)' "$log" || true)
  passed=$((passed + t - f - s)) failed=$((failed + f)) skipped=$((skipped + s))
  # ctest's "The following tests FAILED:" list: "<tab>N - name (Failed)".
  local names
  names=$(sed -n '/^The following tests FAILED:/,/^[^[:space:]]/s/^[[:space:]]\+[0-9]\+ - /  '"$label"': /p' "$log")
  [ -z "$names" ] || failures+="$names"$'\n'
  [ "$rc" = 0 ] || status=$rc
}

run_suite "$BUILD_DIR" "release" "$@"
if [ "${CKPTIO_SANITIZERS:-1}" != 0 ]; then
  # (The sanitizer trees only build to run tests: unity builds, and without
  # the DDP demo and the benchmarks; CMakeLists.txt says why.)
  build_tree "$CKPTIO_ROOT/build-asan" -DCKPTIO_SANITIZE=address,undefined -DCKPTIO_UNITY_BUILD=ON
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    LSAN_OPTIONS=suppressions=$CKPTIO_ROOT/tools/lsan.supp \
    run_suite "$CKPTIO_ROOT/build-asan" "asan+ubsan" "$@"
fi
if [ "${CKPTIO_SANITIZERS:-1}" != 0 ]; then
  # The lock and coordination tests again, under ThreadSanitizer.
  tsan=$CKPTIO_ROOT/build-tsan
  CKPTIO_BUILD_TARGETS="posix_backend_test store_test writer_lock_test coordination_test \
    nfs_store_test nfs_lock_test s3_store_test" \
    build_tree "$tsan" -DCKPTIO_SANITIZE=thread -DCKPTIO_UNITY_BUILD=ON
  TSAN_OPTIONS=halt_on_error=1 run_suite "$tsan" "tsan (locks, coordination)" -L tsan "$@"
  # The NFS lock tests: v4 renewals and releases, v3 leases, on their threads
  # (not with a filter of the caller's: it would pick NFS tests not built here).
  if [ "$filtered" = 0 ]; then
    TSAN_OPTIONS=halt_on_error=1 run_suite "$tsan" "tsan (NFS locks)" -L nfs \
      -R 'Lock|Lease|Renew|Release'
    # s3://: the lease's renewal thread, parts uploaded and ranges read in
    # parallel, a backend shared by threads.
    TSAN_OPTIONS=halt_on_error=1 run_suite "$tsan" "tsan (S3 leases, parallel requests)" -L s3 \
      -R 'Lease|Lock|Racing|Concurrent|LargerThanOnePart|MidSave'
  fi
fi
if [ "${CKPTIO_TORCH2:-1}" != 0 ]; then
  # The tests that touch LibTorch, built against LibTorch 2.6 in a Debian
  # trixie chroot.
  echo "== test suite: LibTorch 2.x (tools/torch2-check.sh)"
  set +e
  "$CKPTIO_ROOT/tools/torch2-check.sh" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" = 77 ]; then
    skipped=$((skipped + 1))
  else
    count "libtorch 2.x" "$rc"
  fi
fi
if [ "${CKPTIO_FUZZ:-1}" != 0 ]; then
  echo "== fuzzing (tools/fuzz.sh, ${CKPTIO_FUZZ_SECONDS:-15} s per target)"
  set +e
  "$CKPTIO_ROOT/tools/fuzz.sh" | tee "$log"
  set -e
  fp=$(sed -n 's/^fuzz: \([0-9]*\) passed, \([0-9]*\) failed$/\1/p' "$log")
  ff=$(sed -n 's/^fuzz: \([0-9]*\) passed, \([0-9]*\) failed$/\2/p' "$log")
  if [ -z "$fp" ]; then
    fp=0 ff=1
    failures+="  fuzzing: tools/fuzz.sh printed no summary (a target did not build?)"$'\n'
  fi
  fl=$(sed -n 's/^fuzz \([a-z_]*\): FAILED.*/  fuzzing: \1/p' "$log")
  [ -z "$fl" ] || failures+="$fl"$'\n'
  passed=$((passed + fp)) failed=$((failed + ff))
  [ "$ff" = 0 ] || status=1
fi
summarized=1
list_failures
echo "ctest: $passed passed, $failed failed, $skipped skipped"
exit "$status"
