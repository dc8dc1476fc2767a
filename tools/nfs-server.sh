#!/usr/bin/env bash
# A user-space NFS server for tests and demos: NFS-Ganesha (VFS backend) on
# 127.0.0.1, exporting one folder over NFSv3 and NFSv4, with rpcbind and
# rpc.statd for v3. No kernel NFS client or server is involved.
#
#   tools/nfs-server.sh start DIR   serve DIR/export; state, config and logs
#                                   live in DIR; prints the URIs
#   tools/nfs-server.sh stop DIR    stop every daemon started for DIR, by PID
#   tools/nfs-server.sh status DIR  exit 0 if Ganesha for DIR is running
#
# Ports (override with CKPTIO_NFS_PORT, CKPTIO_NFS_MOUNT_PORT,
# CKPTIO_NFS_NLM_PORT): 20490 NFS, 20048 mount, 20049 NLM. One server per
# port set: stop it before starting another on the same ports. NFSv4 leases
# last CKPTIO_NFS_LEASE_S seconds (default 10; servers default to 60-90).
# CKPTIO_NFS_MAX_READ=BYTES caps each READ (as small servers do; v3 clients
# are told, v4 ones find out from short answers).
#
# URIs of the export:
#   nfs://127.0.0.1/DIR/export?version=3&nfsport=20490&mountport=20048
#   nfs://127.0.0.1/export?version=4&nfsport=20490     (v4 pseudo path)
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
nfs_port=${CKPTIO_NFS_PORT:-20490}
mnt_port=${CKPTIO_NFS_MOUNT_PORT:-20048}
nlm_port=${CKPTIO_NFS_NLM_PORT:-20049}
helpers=${TMPDIR:-/tmp}/ckptio-nfs-helpers.pids  # rpcbind/statd we started

# Running, and not a zombie (a killed daemon whose parent was not waiting).
alive() {
  [ -f "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null || return 1
  case $(ps -o stat= -p "$pid" 2>/dev/null) in Z*) return 1 ;; esac
}

stop_pid() {  # stop_pid PIDFILE NAME: TERM, then KILL after 5 s
  local f=$1 pid
  alive "$f" || { rm -f "$f"; return 0; }
  pid=$(cat "$f")
  kill -CONT "$pid" 2>/dev/null || true  # a test may have stopped it
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$f"
}

need() {
  local missing=()
  for b in ganesha.nfsd rpcbind rpc.statd; do
    command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || missing+=("$b")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "nfs-server: missing ${missing[*]}: apt-get install nfs-ganesha nfs-ganesha-vfs rpcbind nfs-common (tools/setup.sh does)" >&2
    exit 1
  fi
}

case $cmd in
  start)
    need
    export PATH=$PATH:/usr/sbin
    if alive "$dir/ganesha.pid"; then
      echo "nfs-server: already running for $dir (pid $(cat "$dir/ganesha.pid"))"
      exit 0
    fi
    mkdir -p "$dir/export" "$dir/recovery"
    # rpcbind and rpc.statd are shared by every server on this machine:
    # start them if nobody has, and remember whether we did.
    # Their PIDs go to $helpers, so the last server to stop can stop them.
    if ! pgrep -x rpcbind >/dev/null; then
      setsid rpcbind -f -w </dev/null >/dev/null 2>&1 &
      echo $! >>"$helpers"
      sleep 0.2
    fi
    if ! pgrep -x rpc.statd >/dev/null; then
      setsid rpc.statd -F --no-notify </dev/null >"$dir/statd.log" 2>&1 &
      echo $! >>"$helpers"
    fi
    cat >"$dir/ganesha.conf" <<EOF
NFS_CORE_PARAM {
  Bind_addr = 127.0.0.1;
  NFS_Port = $nfs_port;
  MNT_Port = $mnt_port;
  NLM_Port = $nlm_port;
  Enable_UDP = false;
  Enable_RQUOTA = false;
  Protocols = 3, 4;
}
NFSv4 {
  Graceless = true;
  # A dead client's locks go when its lease ends: short, for tests.
  Lease_Lifetime = ${CKPTIO_NFS_LEASE_S:-10};
  RecoveryRoot = $dir/recovery;
}
EXPORT {
  Export_Id = 1;
  Path = $dir/export;
  Pseudo = /export;
  Access_Type = RW;
  Squash = No_Root_Squash;
  Protocols = 3, 4;
  Transports = TCP;
  SecType = sys;
  # Tests also touch the folder directly: never serve cached attributes.
  Attr_Expiration_Time = 0;
${CKPTIO_NFS_MAX_READ:+  MaxRead = $CKPTIO_NFS_MAX_READ;}
  FSAL { Name = VFS; }
}
LOG { Default_Log_Level = EVENT; }
EOF
    # A server killed a moment ago may leave its ports briefly unusable:
    # Ganesha then exits at once, and we try again for up to ~30 s.
    for attempt in $(seq 30); do
      # Ganesha exits if rpcbind still holds registrations of an earlier
      # server (one killed, or another on other ports): drop them; the
      # URIs above name the ports, so no client needs the portmapper.
      for pv in "100003 3" "100003 4" "100005 1" "100005 3" "100021 4"; do
        rpcinfo -d $pv >/dev/null 2>&1 || true
      done
      : >"$dir/ganesha.log"
      # Detached (own session, no inherited descriptors), so a caller that
      # waits for our output to end (ctest) is not held up by the daemons.
      setsid ganesha.nfsd -F -L "$dir/ganesha.log" -f "$dir/ganesha.conf" \
        -p "$dir/ganesha.pidfile" </dev/null >"$dir/ganesha.out" 2>&1 &
      echo $! >"$dir/ganesha.pid"
      for _ in $(seq 150); do
        if grep -q "NFS SERVER INITIALIZED" "$dir/ganesha.log" 2>/dev/null; then
          echo "nfs-server: Ganesha serving $dir/export (pid $(cat "$dir/ganesha.pid"))"
          echo "  v3: nfs://127.0.0.1$dir/export?version=3&nfsport=$nfs_port&mountport=$mnt_port"
          echo "  v4: nfs://127.0.0.1/export?version=4&nfsport=$nfs_port"
          exit 0
        fi
        alive "$dir/ganesha.pid" || break
        sleep 0.1
      done
      alive "$dir/ganesha.pid" && break  # running but silent for 15 s: give up
      sleep 1
    done
    echo "nfs-server: Ganesha did not start; its log:" >&2
    tail -n 20 "$dir/ganesha.log" "$dir/ganesha.out" >&2
    "$0" stop "$dir" >/dev/null 2>&1 || true
    exit 1
    ;;
  stop)
    stop_pid "$dir/ganesha.pid"
    # The last Ganesha gone: stop the rpcbind and rpc.statd we started.
    if ! pgrep -x ganesha.nfsd >/dev/null && [ -f "$helpers" ]; then
      while read -r pid; do
        echo "$pid" >"$dir/helper.pid"
        stop_pid "$dir/helper.pid"
      done <"$helpers"
      rm -f "$helpers"
    fi
    echo "nfs-server: stopped $dir"
    ;;
  status)
    alive "$dir/ganesha.pid"
    ;;
  *)
    echo "nfs-server: unknown command $cmd (start, stop, status)" >&2
    exit 2
    ;;
esac
