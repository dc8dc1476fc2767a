#!/usr/bin/env bash
# ckptio-launch and signals, with real processes: a signal to the launcher
# reaches everything each rank started (each rank leads a process group),
# and the ranks do not outlive a launcher that is SIGKILLed.
set -euo pipefail
bin=$1
marker=$((900000 + RANDOM))  # a sleep length no other process uses
# The sleep processes themselves (not the launcher's or a shell's command
# line that mentions them).
count() { pgrep -a -x sleep | awk -v m="$1" '$3 == m' | wc -l; }
left() { [ "$(count "$1")" -gt 0 ]; }
gone_within() {  # gone_within MARKER SECONDS
  for _ in $(seq 1 $(($2 * 10))); do left "$1" || return 0; sleep 0.1; done
  return 1
}
cleanup() { pkill -f "sleep $marker" 2>/dev/null || true; pkill -f "sleep $((marker + 1))" 2>/dev/null || true; }
trap cleanup EXIT

# 1. SIGTERM to the launcher: each rank is a shell whose own child sleeps.
"$bin/ckptio-launch" -n 2 -- sh -c "sleep $marker & wait" 2>/dev/null &
launcher=$!
for _ in $(seq 1 50); do [ "$(count $marker)" -ge 2 ] && break; sleep 0.1; done
[ "$(count $marker)" -ge 2 ] || { echo "FAIL: the ranks' sleeps did not start"; exit 1; }
kill -TERM "$launcher"
wait "$launcher" || true
if ! gone_within "$marker" 5; then
  echo "FAIL: a rank's child outlived SIGTERM to the launcher: $(pgrep -fa "sleep $marker")"
  exit 1
fi
echo "SIGTERM to the launcher reached the ranks' children"

# 2. SIGKILL of the launcher: the ranks go with it (parent-death signal;
#    a rank's own children are its to end: only the rank gets the signal).
m2=$((marker + 1))
"$bin/ckptio-launch" -n 2 -- sleep "$m2" 2>/dev/null &
launcher=$!
for _ in $(seq 1 50); do [ "$(count $m2)" -ge 2 ] && break; sleep 0.1; done
[ "$(count $m2)" -ge 2 ] || { echo "FAIL: the ranks did not start"; exit 1; }
kill -KILL "$launcher"
wait "$launcher" 2>/dev/null || true
if ! gone_within "$m2" 5; then
  echo "FAIL: ranks outlived a SIGKILLed launcher: $(pgrep -fa "sleep $m2")"
  exit 1
fi
echo "ranks ended with a SIGKILLed launcher"
