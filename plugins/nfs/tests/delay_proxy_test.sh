#!/usr/bin/env bash
# ckptio-delay-proxy forwards an NFS connection intact and delays it: a
# store written and verified through it (NFSv4, every call through the
# proxy) checks out, and each round trip costs at least 2 x the delay.
# Functional, not a timing: only lower bounds on time are checked.
set -euo pipefail
bin=$1
nfs_dir=${CKPTIO_NFS_DIR:?the nfs fixture sets CKPTIO_NFS_DIR}
port=20890
sub=delay-proxy-$$
mkdir -p "$nfs_dir/export/$sub"
"$bin/ckptio-delay-proxy" --listen $port --to 20490 --delay-us 20000 >/dev/null &
proxy=$!
trap 'kill $proxy 2>/dev/null; rm -rf "$nfs_dir/export/$sub"' EXIT
for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break; sleep 0.1; done

uri="nfs://127.0.0.1/export/$sub?version=4&nfsport=$port"
"$bin/ckptio-gen" "$uri" --steps 1 --objects 2 --size 2M --seed 7 >/dev/null
ms() { date +%s%3N; }
t0=$(ms)
"$bin/ckptio" verify "$uri" >"/tmp/$sub.log" 2>&1 || { cat "/tmp/$sub.log"; echo "FAIL: verify through the proxy"; exit 1; }
took=$(($(ms) - t0))
rm -f "/tmp/$sub.log"
# Mounting alone takes several round trips of 40 ms each.
[ "$took" -ge 200 ] || { echo "FAIL: verify through a 20 ms proxy took only $took ms"; exit 1; }
"$bin/ckptio" verify "nfs://127.0.0.1/export/$sub?version=4&nfsport=20490" >/dev/null
echo "delay proxy: a store written and verified through it checks out (verify: $took ms)"
