#!/usr/bin/env bash
# The DDP demo (4 real ranks, each with its own S3 client) against a real
# S3 server (Ceph RGW): rank 0 saves over s3://, the others wait and load.
# Every run must end with the parameters of an uninterrupted run on local
# disk:
#   - manifest wait, rank 0 SIGKILLed mid-save: the waiters reach their
#     deadline; relaunched, it resumes from the last committed step;
#   - store wait (the job's c10d TCPStore, served by rank 0), likewise: the
#     waiters learn of the death from the lost store;
#   - ckptio ls, gc and export on the store it left;
#   - file-lock wait is refused, naming the modes that work.
# Usage: ddp_s3_test.sh BIN_DIR   (the server: $CKPTIO_RGW_DIR, as ctest's
# fixture sets it, or one this script starts)
set -euo pipefail
bin=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
server=${CKPTIO_RGW_DIR:-}
command -v radosgw >/dev/null || { echo "SKIP: Ceph radosgw is not installed (tools/setup.sh installs it)"; exit 77; }
if [ -z "$server" ]; then
  server=$tmp/rgw
  CKPTIO_RGW_PORT=${CKPTIO_RGW_PORT:-20680} CKPTIO_CEPH_MON_PORT=${CKPTIO_CEPH_MON_PORT:-20789} \
    "$here/../../../tools/rgw-server.sh" start "$server" >/dev/null
  trap '"$here/../../../tools/rgw-server.sh" stop "$server" >/dev/null; rm -rf "$tmp"' EXIT
else
  trap 'rm -rf "$tmp"' EXIT
fi
set -a
# shellcheck disable=SC1091
. "$server/env"
set +a
run=ddp-$$-$RANDOM
uri() { echo "s3://$CKPTIO_S3_BUCKET/$run/$1?lease_ms=3000"; }
label=s3
# shellcheck source=../../../tests/lib/ddp_kill_resume.sh
. "$here/../../../tests/lib/ddp_kill_resume.sh"
reference_run

kill_and_resume "manifest" "$(uri a)" manifest "DEADLINE_EXCEEDED.*step 20" 5
kill_and_resume "store" "$(uri b)" store \
  "UNAVAILABLE.*lost the c10d store while waiting for rank 0 to commit step 20" 30

# The tools on the store the demo left: ls, gc, export (torch.load reads it).
store=$(uri a)
"$bin/ckptio" ls "$store" >"$tmp/log" 2>&1 || fail "ckptio ls"
grep -q "40  committed" "$tmp/log" || fail "ckptio ls does not show step 40 committed"
"$bin/ckptio" gc "$store" --keep 1 >"$tmp/log" 2>&1 || fail "ckptio gc"
"$bin/ckptio" ls --json "$store" >"$tmp/ls.json" 2>"$tmp/log" || fail "ckptio ls --json"
/usr/bin/python3 -c 'import json,sys; s=[x["step"] for x in json.load(open(sys.argv[1]))["steps"]]; sys.exit(s != [40])' \
  "$tmp/ls.json" || { cat "$tmp/ls.json" >"$tmp/log"; fail "after gc --keep 1 the store holds other steps than 40"; }
"$bin/ckptio" export "$store" latest -o "$tmp/out.pt" >"$tmp/log" 2>&1 || fail "ckptio export"
/usr/bin/python3 -c 'import sys, torch; d = torch.load(sys.argv[1]); assert len(d) > 0' "$tmp/out.pt" \
  >"$tmp/log" 2>&1 || fail "torch.load of the export"
echo "ckptio ls, gc --keep 1 and export (loaded by torch.load) work on s3://"

set +e
demo --store "$(uri c)" --wait file-lock --timeout 10 >"$tmp/log" 2>&1
rc=$?
set -e
[ "$rc" != 0 ] || fail "file-lock: the run over s3:// exited 0"
grep -q "use wait mode manifest.*or store" "$tmp/log" || fail "file-lock: the refusal does not name the modes that work"
echo "ddp over s3 (file-lock): refused, naming the wait modes that work"
