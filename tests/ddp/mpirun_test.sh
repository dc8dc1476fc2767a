#!/usr/bin/env bash
# The DDP demo runs unchanged under Open MPI's mpirun (rank identity from
# OMPI_COMM_WORLD_*, loopback only) and matches a ckptio-launch run.
set -euo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
command -v mpirun >/dev/null || { echo "SKIP: mpirun not installed"; exit 77; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mpirun --allow-run-as-root --oversubscribe -np 4 --mca oob_tcp_if_include lo \
  --mca btl self,tcp --mca btl_tcp_if_include lo -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" \
  "$bin/ckptio-ddp-demo" --store "$tmp/mpi" --steps 20 --every 10 >"$tmp/mpi.log" 2>&1 ||
  { cat "$tmp/mpi.log"; exit 1; }
"$bin/ckptio-launch" -n 4 -- "$bin/ckptio-ddp-demo" --store "$tmp/launch" --steps 20 --every 10 \
  >"$tmp/launch.log" 2>&1 || { cat "$tmp/launch.log"; exit 1; }
a=$(sed -n 's/^final parameter hash: //p' "$tmp/mpi.log")
b=$(sed -n 's/^final parameter hash: //p' "$tmp/launch.log")
[ -n "$a" ] && [ "$a" = "$b" ] || { cat "$tmp/mpi.log"; echo "FAIL: mpirun hash '$a' != launch hash '$b'"; exit 1; }
"$bin/ckptio" verify "$tmp/mpi" --all >/dev/null
echo "ddp demo under mpirun -np 4: final hash $a, same as ckptio-launch"
