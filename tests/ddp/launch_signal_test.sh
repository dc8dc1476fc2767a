#!/usr/bin/env bash
# ckptio-launch and signals, with real processes: a signal to the launcher
# reaches everything each rank started (each rank leads a process group),
# the ranks do not outlive a launcher that is SIGKILLed, ranks that ignore
# SIGTERM are killed --grace seconds after it (at once on a second one), a
# signal ignored at startup (nohup) stays ignored, an ignored SIGCHLD
# does not hide how the ranks ended, and usage errors exit 2.
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
got=$(mktemp)  # section 3's ranks note what they got here
cleanup() {
  # SIGKILL: some of these ranks ignore SIGTERM.
  for m in $(seq "$marker" $((marker + 4))); do pkill -KILL -f "sleep $m" 2>/dev/null || true; done
  rm -f "$got"
}
# started MARKER N: waits until N sleeps of MARKER run.
started() {
  for _ in $(seq 1 50); do [ "$(count "$1")" -ge "$2" ] && return 0; sleep 0.1; done
  echo "FAIL: the ranks' sleeps did not start"
  exit 1
}
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

# 3. Ranks that ignore SIGTERM: killed --grace seconds after a forwarded one,
#    and at once after a second one.
m3=$((marker + 2))
"$bin/ckptio-launch" -n 2 --grace 4 -- sh -c "trap '' TERM; sleep $m3 & wait" 2>/dev/null &
launcher=$!
started "$m3" 2
kill -TERM "$launcher"
sleep 2
left "$m3" || { echo "FAIL: SIGTERM-ignoring ranks ended 2 s into --grace 4"; exit 1; }
if ! gone_within "$m3" 7; then
  echo "FAIL: ranks ignoring SIGTERM outlived --grace 4 by 5 s: $(pgrep -fa "sleep $m3")"
  exit 1
fi
wait "$launcher" || true
# Each rank notes in $got that it is set up and then the forwarded SIGTERM
# (its sleep ignores it), so the second is sent only after the launcher
# passed the first on: two sent at once could reach it as one.
noted() {  # noted WORD: waits until both ranks wrote WORD to $got
  for _ in $(seq 1 50); do [ "$(grep -c "^$1$" "$got")" -ge 2 ] && return 0; sleep 0.1; done
  return 1
}
"$bin/ckptio-launch" -n 2 --grace 600 -- sh -c "trap '' TERM; sleep $m3 & s=\$!; \
  trap 'echo TERM >>\"$got\"' TERM; echo up >>\"$got\"; while kill -0 \$s; do wait \$s; done" \
  2>/dev/null &
launcher=$!
noted up || { echo "FAIL: the ranks did not start"; exit 1; }
started "$m3" 2
kill -TERM "$launcher"
noted TERM || { echo "FAIL: the launcher did not forward SIGTERM to both ranks"; exit 1; }
kill -TERM "$launcher"
if ! gone_within "$m3" 3; then
  echo "FAIL: a second SIGTERM did not kill the ranks: $(pgrep -fa "sleep $m3")"
  exit 1
fi
wait "$launcher" || true
echo "ranks ignoring SIGTERM were killed after --grace, and at once on a second SIGTERM"

# 4. nohup: SIGHUP ignored when the launcher starts stays ignored.
m4=$((marker + 3))
(trap '' HUP; exec "$bin/ckptio-launch" -n 2 -- sleep "$m4") 2>/dev/null &
launcher=$!
started "$m4" 2
kill -HUP "$launcher"
sleep 0.5
[ "$(count "$m4")" -eq 2 ] || { echo "FAIL: SIGHUP ended ranks started under nohup"; exit 1; }
kill -0 "$launcher" || { echo "FAIL: SIGHUP ended a launcher started under nohup"; exit 1; }
kill -TERM "$launcher"
gone_within "$m4" 5 || { echo "FAIL: the ranks outlived SIGTERM"; exit 1; }
wait "$launcher" || true
echo "SIGHUP ignored at startup stayed ignored"

# 5. SIGCHLD ignored when the launcher starts: it still sees the ranks end.
set +e
timeout 10 perl -e '$SIG{CHLD} = "IGNORE"; exec @ARGV or die' \
  "$bin/ckptio-launch" -n 2 -- sh -c 'exit 3' 2>/dev/null
rc=$?
set -e
[ "$rc" = 3 ] || { echo "FAIL: with SIGCHLD ignored the launcher exited $rc, not the ranks' 3"; exit 1; }
echo "SIGCHLD ignored at startup: the ranks' exit status still came through"

# 6. On a terminal (script(1) gives the launcher one), the ranks are not in
#    its foreground process group: reading stdin must give them end-of-file,
#    not stop them (SIGTTIN) and stall the job; a rank stopped for using the
#    terminal anyway (SIGTTOU: changing its settings) fails the job at once.
on_terminal() {  # on_terminal LOG COMMAND: runs COMMAND on a pseudo-terminal
  timeout 20 script -qec "$2" /dev/null </dev/null >"$1" 2>&1
}
log=$(mktemp)
trap 'cleanup; rm -f "$log"' EXIT
set +e
on_terminal "$log" "$bin/ckptio-launch -n 2 -- sh -c 'if read x; then exit 3; fi; echo ate-eof'"
rc=$?
set -e
if [ "$rc" != 0 ] || [ "$(grep -c ate-eof "$log")" != 2 ]; then
  echo "FAIL: ranks reading a terminal stdin did not get end-of-file (rc $rc; 124: stalled):"
  cat "$log"
  exit 1
fi
echo "ranks reading stdin on a terminal got end-of-file"
set +e
on_terminal "$log" "$bin/ckptio-launch -n 2 --grace 600 -- sh -c 'stty -echo </dev/tty; sleep 600'"
rc=$?
set -e
if [ "$rc" = 0 ] || [ "$rc" = 124 ] || ! grep -q "stopped by signal $(kill -l TTOU)" "$log" ||
  ! grep -q "cannot go on; stopping the rest" "$log"; then
  echo "FAIL: a rank stopped by SIGTTOU did not end the job at once with a reason (rc $rc; 124: stalled):"
  cat "$log"
  exit 1
fi
echo "a rank stopped by SIGTTOU ended the job at once: $(grep -m1 'stopped by' "$log" | tr -d '\r')"

# 8. Usage errors exit 2 (as ckptio's other tools), never a code a rank could
# return, and --grace is a finite number of seconds (nan, or one that
# overflows the deadline, once stopped the ranks at once).
for args in "-n 0 -- true" "-n 2 --" "--grace nan -- true" "--grace 1e10 -- true" \
  "--grace -1 -- true"; do
  set +e
  "$bin/ckptio-launch" $args >/dev/null 2>&1
  rc=$?
  set -e
  [ "$rc" = 2 ] || { echo "FAIL: ckptio-launch $args exited $rc, not 2 (usage)"; exit 1; }
done
echo "usage errors (-n 0, no PROGRAM, --grace nan/1e10/-1) exit 2"
