#!/usr/bin/env bash
# The DDP demo (4 real ranks, each with its own NFS client connection)
# against a real NFS server: rank 0 saves over nfs://, the others wait and
# load. Every run must end with the parameters of an uninterrupted run on
# local disk:
#   - NFSv3, manifest wait, rank 0 SIGKILLed mid-save, relaunched;
#   - NFSv4, file-lock wait (v4 locks), rank 0 SIGKILLed mid-save: waiters
#     learn of the death when its lease ends; relaunched;
#   - NFSv3, file-lock wait (lease files), likewise;
#   - mixed: rank 0 writes over NFSv4, ranks 2 and 3 read the exported
#     folder through the POSIX backend.
# Usage: ddp_nfs_test.sh BIN_DIR   (the server: $CKPTIO_NFS_DIR, as ctest's
# fixture sets it, or one this script starts)
set -euo pipefail
bin=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
server=${CKPTIO_NFS_DIR:-}
if [ -z "$server" ]; then
  server=$tmp/nfs
  "$here/../../../tools/nfs-server.sh" start "$server" >/dev/null
  trap '"$here/../../../tools/nfs-server.sh" stop "$server" >/dev/null; rm -rf "$tmp"' EXIT
else
  trap 'rm -rf "$tmp"' EXIT
fi
export_dir=$server/export
run=ddp-$$
mkdir -p "$export_dir/$run"
v3() { echo "nfs://127.0.0.1$export_dir/$run/$1?version=3&nfsport=20490&mountport=20048&lease_ms=3000"; }
v4() { echo "nfs://127.0.0.1/export/$run/$1?version=4&nfsport=20490"; }
label=nfs
# shellcheck source=../../../tests/lib/ddp_kill_resume.sh
. "$here/../../../tests/lib/ddp_kill_resume.sh"
reference_run

kill_and_resume "v3, manifest" "$(v3 a)" manifest "DEADLINE_EXCEEDED.*step 20" 5
kill_and_resume "v4, file-lock" "$(v4 b)" file-lock "writer died before committing step 20" 30
kill_and_resume "v3, file-lock" "$(v3 d)" file-lock "writer died before committing step 20" 30

demo --store "$(v4 c)" --wait manifest --rank-store "2=$export_dir/$run/c" \
  --rank-store "3=$export_dir/$run/c" >"$tmp/log" 2>&1 || fail "mixed access"
[ "$(hash_of "$tmp/log")" = "$clean" ] || fail "mixed: final hash differs from the local run"
echo "ddp over nfs (mixed): rank 0 over NFSv4, ranks 2-3 through the POSIX backend on the export; final hash = local run"
