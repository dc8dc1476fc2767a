#!/usr/bin/env bash
# ckptio-delay-proxy delays both directions and forwards bytes intact:
#  1. through it to an echo server, a 1-byte round trip takes at least
#     2 x the delay, and 4 MiB come back unchanged;
#  2. a store written and verified through it (NFSv4, every call through
#     the proxy) checks out, and verifies again straight from the server.
# Functional, not a timing: only lower bounds on time are checked.
set -euo pipefail
bin=$1
nfs_dir=${CKPTIO_NFS_DIR:?the nfs fixture sets CKPTIO_NFS_DIR}
tmp=$(mktemp -d)
sub=delay-proxy-$$
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$tmp" "${nfs_dir:?}/export/$sub"
}
trap cleanup EXIT

# Starts a proxy LISTEN -> TO with DELAY_US, and waits until it listens.
proxy() {
  "$bin/ckptio-delay-proxy" --listen "$1" --to "$2" --delay-us "$3" >"$tmp/proxy-$1.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 50); do
    grep -q "ckptio-delay-proxy: 127" "$tmp/proxy-$1.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$pid" 2>/dev/null || { cat "$tmp/proxy-$1.log"; echo "FAIL: the proxy on $1 did not start"; exit 1; }
}

# 1. Round trips through an echo server, 100 ms each way.
/usr/bin/python3 - 20891 >"$tmp/echo.log" 2>&1 <<'PY' &
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(4); print("listening", flush=True)
def serve(c):
    while (b := c.recv(1 << 20)):
        c.sendall(b)
    c.close()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
PY
pids+=($!)
for _ in $(seq 50); do grep -q listening "$tmp/echo.log" && break; sleep 0.1; done
proxy 20892 20891 100000
/usr/bin/python3 - 20892 <<'PY'
import os, socket, sys, time
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(3):
    t = time.monotonic(); c.sendall(b"x")
    assert c.recv(1) == b"x"
    rtt = time.monotonic() - t
    assert rtt >= 0.2, "a round trip through a 100 ms proxy took %.3f s" % rtt
data = os.urandom(4 << 20); c.sendall(data); back = b""
while len(back) < len(data):
    back += c.recv(1 << 20)
assert back == data, "4 MiB came back changed"
print("delay proxy: round trips take >= 2 x 100 ms; 4 MiB echoed intact")
PY

# 2. A store through it (20 ms each way).
proxy 20890 20490 20000
mkdir -p "$nfs_dir/export/$sub"
uri="nfs://127.0.0.1/export/$sub?version=4&nfsport=20890"
"$bin/ckptio-gen" "$uri" --steps 1 --objects 2 --size 2M --seed 7 >/dev/null
"$bin/ckptio" verify "$uri" >"$tmp/verify.log" 2>&1 ||
  { cat "$tmp/verify.log"; echo "FAIL: verify through the proxy"; exit 1; }
"$bin/ckptio" verify "nfs://127.0.0.1/export/$sub?version=4&nfsport=20490" >"$tmp/verify.log" 2>&1 ||
  { cat "$tmp/verify.log"; echo "FAIL: verify straight from the server"; exit 1; }
echo "delay proxy: a store written and verified through it checks out"
