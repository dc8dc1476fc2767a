#!/usr/bin/env bash
# The DDP demo, 4 real ranks: an uninterrupted run, and a run whose rank 0 is
# SIGKILLed while writing a checkpoint and then relaunched, must end with
# bit-identical parameters; the killed step must never be committed; every
# wait mode gives the same result. A relaunch that repeats the job id is
# refused in the file-based wait modes.
set -euo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
hash_of() { sed -n 's/^final parameter hash: //p' "$1"; }

"$bin/ckptio-launch" -n 4 -- "$bin/ckptio-ddp-demo" --store "$tmp/clean" --steps 40 --every 10 >"$tmp/clean.log" 2>&1
clean=$(hash_of "$tmp/clean.log")
[ -n "$clean" ] || { cat "$tmp/clean.log"; echo "FAIL: no hash from the clean run"; exit 1; }

for wait in file-lock manifest store; do
  store=$tmp/crash-$wait
  # The manifest mode's waiters learn of the death only by their deadline;
  # the others see it at once, and a long deadline spares them a slow start
  # of the four ranks on a busy machine.
  timeout=30
  [ "$wait" != manifest ] || timeout=5
  set +e
  "$bin/ckptio-launch" -n 4 --grace 20 -- "$bin/ckptio-ddp-demo" --store "$store" --steps 40 \
    --every 10 --wait "$wait" --timeout "$timeout" --kill-rank0-during-save=20 >"$tmp/kill.log" 2>&1
  rc=$?
  set -e
  [ "$rc" != 0 ] || { cat "$tmp/kill.log"; echo "FAIL ($wait): the killed run exited 0"; exit 1; }
  grep -q "rank 0 killed by signal 9" "$tmp/kill.log" || { cat "$tmp/kill.log"; echo "FAIL ($wait): rank 0 was not killed"; exit 1; }
  if [ "$wait" = file-lock ]; then
    n=$(grep -c "writer died before committing step 20" "$tmp/kill.log" || true)
    [ "$n" = 3 ] || { cat "$tmp/kill.log"; echo "FAIL: $n of 3 waiters reported the dead writer"; exit 1; }
  elif [ "$wait" = manifest ]; then
    n=$(grep -c "DEADLINE_EXCEEDED.*step 20" "$tmp/kill.log" || true)
    [ "$n" = 3 ] || { cat "$tmp/kill.log"; echo "FAIL ($wait): $n of 3 waiters timed out naming step 20"; exit 1; }
  else
    # The demo's rank 0 serves the TCPStore, so its death takes the store down.
    n=$(grep -c "UNAVAILABLE.*lost the c10d store while waiting for rank 0 to commit step 20" "$tmp/kill.log" || true)
    [ "$n" = 3 ] || { cat "$tmp/kill.log"; echo "FAIL ($wait): $n of 3 waiters reported the lost store"; exit 1; }
  fi
  "$bin/ckptio" ls --json "$store" >"$tmp/ls.json"
  states=$(/usr/bin/python3 -c 'import json,sys; print(" ".join("%d:%s" % (s["step"], s["state"]) for s in json.load(sys.stdin)["steps"]))' <"$tmp/ls.json")
  case " $states " in
    *" 10:committed "*) ;;
    *) echo "FAIL ($wait): step 10 is not committed: $states"; exit 1 ;;
  esac
  # Killed mid-write: an object of step 20 is on disk, its manifest is not.
  case " $states " in
    *" 20:torn "*) ;;
    *) echo "FAIL ($wait): step 20 is not torn (rank 0 died writing it): $states"; exit 1 ;;
  esac
  "$bin/ckptio-launch" -n 4 -- "$bin/ckptio-ddp-demo" --store "$store" --steps 40 --every 10 \
    --wait "$wait" >"$tmp/resume.log" 2>&1
  grep -q "resumed from step 10" "$tmp/resume.log" || { cat "$tmp/resume.log"; echo "FAIL ($wait): did not resume from step 10"; exit 1; }
  resumed=$(hash_of "$tmp/resume.log")
  [ "$resumed" = "$clean" ] || { echo "FAIL ($wait): resumed hash $resumed != clean $clean"; exit 1; }
  "$bin/ckptio" verify "$store" --all >/dev/null
  echo "ddp demo ($wait): killed at step 20, resumed from 10, final hash $resumed = uninterrupted run"
done

# A job id repeated by hand (--job-id, or CKPTIO_JOB_ID): the second launch's
# rank 0 refuses it before anything is loaded, since its ranks would take the
# first launch's records for their own.
for wait in file-lock manifest; do
  store=$tmp/reused-$wait
  "$bin/ckptio-launch" -n 2 --job-id fixed -- "$bin/ckptio-ddp-demo" --store "$store" --steps 20 \
    --every 10 --wait "$wait" >"$tmp/first.log" 2>&1 || { cat "$tmp/first.log"; echo "FAIL ($wait): first run"; exit 1; }
  set +e
  "$bin/ckptio-launch" -n 2 --job-id fixed -- "$bin/ckptio-ddp-demo" --store "$store" --steps 30 \
    --every 10 --wait "$wait" --timeout 5 >"$tmp/reused.log" 2>&1
  rc=$?
  set -e
  [ "$rc" != 0 ] || { cat "$tmp/reused.log"; echo "FAIL ($wait): a repeated job id was accepted"; exit 1; }
  grep -q 'FAILED_PRECONDITION.*job id "fixed" was used before' "$tmp/reused.log" || { cat "$tmp/reused.log"; echo "FAIL ($wait): rank 0 did not refuse the repeated job id"; exit 1; }
  echo "ddp demo ($wait): a relaunch under the same --job-id refused by rank 0"
done
