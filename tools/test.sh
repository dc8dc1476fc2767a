#!/usr/bin/env bash
# Builds ckptio (installing missing Debian packages) and runs the whole test
# suite with ctest. The last line is the summary: "ctest: N passed, N failed".
# Extra arguments go to ctest (e.g. -R Manifest).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure -j"$(nproc)" --timeout 600 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1 || true)
if [ -z "$summary" ]; then
  echo "ctest: no summary (exit $rc)"
  exit $((rc ? rc : 1))
fi
failed=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$summary")
total=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$summary")
skipped=$(grep -c '(Skipped)' "$log" || true)
echo "ctest: $((total - failed - skipped)) passed, $failed failed, $skipped skipped"
exit "$rc"
