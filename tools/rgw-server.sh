#!/usr/bin/env bash
# A throw-away S3 server for tests and demos: a single-node Ceph cluster
# (one ceph-mon, one ceph-osd, no mgr, auth none) with the RADOS Gateway
# on 127.0.0.1, a test user and one bucket.
#
#   tools/rgw-server.sh start DIR   start (or restart what is missing); data,
#                                   config and logs live in DIR; prints the
#                                   S3 settings as KEY=VALUE lines (stdout,
#                                   also written to DIR/env)
#   tools/rgw-server.sh stop DIR    stop every daemon started for DIR, by PID
#   tools/rgw-server.sh status DIR  exit 0 if all three daemons for DIR run
#
# Ports (override with CKPTIO_RGW_PORT, CKPTIO_CEPH_MON_PORT): 20080 S3 (HTTP),
# 20789 monitor; the OSD takes ports from the 8 after the monitor's. Give
# each DIR its own ports to run several side by side.
# CKPTIO_RGW_STORE=memstore (default: in memory, kept across stop/start,
# lost when the OSD is killed) or bluestore (a sparse file, survives
# SIGKILL, slower to start); CKPTIO_RGW_STORE_GIB caps it (default 4).
# CKPTIO_RGW_START_TIMEOUT_S bounds start (default 60).
#
# Use it with: set -a; . DIR/env; set +a   (path-style addressing, SigV4)
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"  # the header comment
  exit 2
fi
if [ ! -d "$dir" ]; then  # nothing ever ran there
  case $cmd in
    stop) echo "rgw-server: no $dir: nothing to stop" >&2; exit 0 ;;
    status) exit 1 ;;
    start) mkdir -p "$dir" ;;
  esac
fi
[ ! -d "$dir" ] || dir=$(cd "$dir" && pwd)
rgw_port=${CKPTIO_RGW_PORT:-20080}
mon_port=${CKPTIO_CEPH_MON_PORT:-20789}
store=${CKPTIO_RGW_STORE:-memstore}
store_gib=${CKPTIO_RGW_STORE_GIB:-4}
timeout_s=${CKPTIO_RGW_START_TIMEOUT_S:-60}
conf=$dir/ceph.conf
# Fixed test credentials and bucket; RGW's default zonegroup takes any
# region name in a SigV4 scope, us-east-1 is what S3 clients assume.
access_key=CKPTIOTESTACCESSKEY0
secret_key=ckptio-test-secret-key-not-a-secret-000
region=us-east-1
bucket=ckptio-test
daemons=(radosgw osd mon)  # the order they stop in

say() { echo "rgw-server: $*" >&2; }

# Running, and not a zombie (a killed daemon whose parent was not waiting).
running() {
  [ -f "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null || return 1
  case $(ps -o stat= -p "$pid" 2>/dev/null) in Z*) return 1 ;; esac
}

# Running and still ours: it runs with DIR's ceph.conf (PIDs get reused).
alive() {
  running "$1" &&
    { tr '\0' ' ' <"/proc/$(cat "$1")/cmdline"; } 2>/dev/null | grep -qF -- "-c $conf "
}

# stop_pid PIDFILE SECONDS: TERM, then KILL after SECONDS; 0 if TERM did it.
stop_pid() {
  local f=$1 pid
  alive "$f" || { rm -f "$f"; return 0; }
  pid=$(cat "$f")
  kill -CONT "$pid" 2>/dev/null || true  # a test may have stopped it
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq $(($2 * 10))); do
    alive "$f" || { rm -f "$f"; return 0; }
    sleep 0.1
  done
  say "$(basename "$f" .pid) (pid $pid) ignored SIGTERM for $2 s: SIGKILL"
  kill_pid "$f"
  return 1
}

kill_pid() {  # kill_pid PIDFILE: SIGKILL, and wait (2 s at most) until gone
  local f=$1
  if alive "$f"; then
    kill -KILL "$(cat "$f")" 2>/dev/null || true
    for _ in $(seq 20); do running "$f" || break; sleep 0.1; done
  fi
  rm -f "$f"
}

left() { echo $((deadline > SECONDS ? deadline - SECONDS : 1)); }  # seconds

need() {
  local missing=()
  for b in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool uuidgen curl; do
    command -v "$b" >/dev/null || missing+=("$b")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "missing ${missing[*]}: apt-get install --no-install-recommends" \
      "ceph-mon ceph-osd radosgw ceph-common curl (tools/setup.sh does)"
    exit 1
  fi
}

# Something listens on 127.0.0.1:PORT (or on every address).
port_busy() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# s3 METHOD PATH [CURL ARGS...]: a SigV4-signed request; prints the status.
# curl 7.88 signs no payload hash and RGW wants one: UNSIGNED-PAYLOAD.
s3() {
  local method=$1 path=$2
  shift 2
  curl -sS -o "$dir/log/curl.out" -w '%{http_code}' --max-time 10 \
    --aws-sigv4 "aws:amz:$region:s3" --user "$access_key:$secret_key" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -X "$method" "$@" \
    "http://127.0.0.1:$rgw_port$path" 2>>"$dir/log/curl.err" || true
}

env_lines() {
  cat <<EOF
AWS_ENDPOINT_URL=http://127.0.0.1:$rgw_port
AWS_ACCESS_KEY_ID=$access_key
AWS_SECRET_ACCESS_KEY=$secret_key
AWS_REGION=$region
CKPTIO_S3_BUCKET=$bucket
EOF
}

failed() {  # failed WHAT: log tails, stop what we started, exit 1
  say "$1; the daemons' logs:"
  local logs=()
  for f in mkfs.out mon.a.log mon.out osd.0.log osd.out client.rgw.ckptio.log radosgw.out; do
    [ ! -s "$dir/log/$f" ] || logs+=("$dir/log/$f")
  done
  [ ${#logs[@]} -eq 0 ] || tail -n 15 "${logs[@]}" >&2
  if tail -n 200 "$dir/log/osd.0.log" 2>/dev/null | grep -q 'full status failsafe engaged'; then
    say "the OSD's store is full (memstore_device_bytes, or the disk under $dir):" \
      "remove $dir to start an empty cluster"
  fi
  stop_all 2>/dev/null
  exit 1
}

stop_all() {
  # RGW first: with its monitor or OSD gone it hangs on SIGTERM.
  stop_pid "$dir/radosgw.pid" 10 || true
  # A memstore OSD writes its data to DIR on SIGTERM: give it time.
  if alive "$dir/osd.pid"; then
    if stop_pid "$dir/osd.pid" 60; then touch "$dir/osd.clean"; fi
  else
    rm -f "$dir/osd.pid"
  fi
  stop_pid "$dir/mon.pid" 10 || true
}

write_conf() {
  local store_conf
  if [ "$store" = bluestore ]; then
    store_conf="osd_objectstore = bluestore
bluestore_block_size = $((store_gib << 30))
bluestore_block_create = true
bluestore_fsck_on_mount = false
bluestore_cache_autotune = false
bluestore_cache_size = 134217728
osd_memory_target = 939524096"
  else
    store_conf="osd_objectstore = memstore
memstore_device_bytes = $((store_gib << 30))"
  fi
  cat >"$conf" <<EOF
# Written by tools/rgw-server.sh; rewritten on every start.
[global]
fsid = $(cat "$dir/fsid")
mon_host = [v2:127.0.0.1:$mon_port]
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
ms_bind_msgr1 = false
ms_bind_port_min = $((mon_port + 1))
ms_bind_port_max = $((mon_port + 8))
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
# With auth none, RGW loops on "get_initial_auth_request returned -13"
# unless its monitor sessions use crc mode.
ms_mon_client_mode = crc
keyring = /dev/null
admin_socket =
pid_file =
run_dir = $dir/run
crash_dir = $dir/crash
log_file = $dir/log/\$name.log
mon_cluster_log_file = $dir/log/cluster.log
log_to_stderr = false
mon_data = $dir/mon
osd_data = $dir/osd
rgw_data = $dir/rgw
# Proposals every 50 ms instead of 1 s: cold start ~2 s instead of ~13 s.
paxos_propose_interval = 0.05
mon_data_avail_crit = 0
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_pool_default_size = 1
osd_pool_default_min_size = 1
# One OSD: RGW's pools at the default pg_num exceed its PG limit.
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
# A memstore OSD writes its data out only on a slow shutdown.
osd_fast_shutdown = false
$store_conf
rgw_frontends = beast endpoint=127.0.0.1:$rgw_port tcp_nodelay=1
rgw_thread_pool_size = 64
rgw_dynamic_resharding = false
rgw_enable_usage_log = false
# A deleted object's data stays in RADOS until RGW's garbage collector runs,
# by default two hours later: the tests and the benchmark write and delete
# gigabytes, which filled the memstore OSD (then every write waits for
# space for ever). Collect at once, every few seconds.
rgw_gc_obj_min_wait = 0
rgw_gc_processor_period = 5
rgw_gc_processor_max_time = 5
EOF
}

# A fresh cluster: monitor store, OSD id 0 (the monitor runs after), the
# store kind in DIR/store.
create() {
  rm -rf "$dir/mon" "$dir/osd" "$dir/rgw" "$dir/osd.clean"
  mkdir -p "$dir/mon" "$dir/osd" "$dir/rgw"
  uuidgen >"$dir/fsid"
  write_conf
  monmaptool --create --clobber --fsid "$(cat "$dir/fsid")" \
    --addv a "[v2:127.0.0.1:$mon_port]" "$dir/monmap" >"$dir/log/mkfs.out" 2>&1 ||
    failed "monmaptool failed"
  timeout "$(left)" ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" \
    >>"$dir/log/mkfs.out" 2>&1 || failed "ceph-mon --mkfs failed"
  spawn mon ceph-mon -i a
  local osd_uuid id
  osd_uuid=$(uuidgen)
  id=$(timeout "$(left)" ceph -c "$conf" --connect-timeout 30 \
    osd new "$osd_uuid" 2>>"$dir/log/mkfs.out") || failed "ceph osd new failed"
  [ "$id" = 0 ] || failed "ceph osd new gave OSD id '$id', not 0"
  timeout "$(left)" ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" \
    >>"$dir/log/mkfs.out" 2>&1 || failed "ceph-osd --mkfs failed"
  echo "$store" >"$dir/store"
}

spawn() {  # spawn NAME COMMAND...: detached, foreground mode, PID kept
  local name=$1
  shift
  # Own session, no inherited descriptors: a caller that waits for our
  # output to end (ctest) is not held up by the daemons, nor is a later
  # start or stop by our lock.
  setsid "$@" -f -c "$conf" </dev/null >"$dir/log/$name.out" 2>&1 9>&- &
  echo $! >"$dir/$name.pid"
}

case $cmd in start | stop)  # one at a time per DIR
  exec 9>"$dir/lock"
  flock 9
esac

case $cmd in
  start)
    need
    mkdir -p "$dir/log" "$dir/run" "$dir/crash"
    if alive "$dir/radosgw.pid" && alive "$dir/osd.pid" && alive "$dir/mon.pid"; then
      say "already running for $dir (radosgw pid $(cat "$dir/radosgw.pid"))"
      cat "$dir/env" 2>/dev/null || env_lines
      exit 0
    fi
    case $store in
      memstore | bluestore) ;;
      *) say "CKPTIO_RGW_STORE=$store: use memstore or bluestore"; exit 2 ;;
    esac
    busy=()
    alive "$dir/mon.pid" || {
      port_busy "$mon_port" && busy+=("$mon_port (monitor)")
      for p in $(seq $((mon_port + 1)) $((mon_port + 8))); do
        alive "$dir/osd.pid" || ! port_busy "$p" || busy+=("$p (OSD)")
      done
    }
    alive "$dir/radosgw.pid" || ! port_busy "$rgw_port" || busy+=("$rgw_port (S3)")
    if [ ${#busy[@]} -gt 0 ]; then
      say "in use on this machine: port $(printf '%s, ' "${busy[@]}" | sed 's/, $//');" \
        "stop what holds it (ss -ltnp shows it) or choose other ports with CKPTIO_RGW_PORT and" \
        "CKPTIO_CEPH_MON_PORT (the OSD takes the 8 ports after the monitor's)"
      exit 1
    fi
    deadline=$((SECONDS + timeout_s))
    # A memstore OSD that did not stop cleanly left stale or no data, and
    # a store of the other kind is no use: start from nothing then.
    fresh=""
    if [ ! -f "$dir/mon/store.db/CURRENT" ] || [ ! -f "$dir/osd/whoami" ]; then
      fresh=1
    elif [ "$(cat "$dir/store" 2>/dev/null)" != "$store" ]; then
      say "$dir holds a $(cat "$dir/store" 2>/dev/null) cluster, CKPTIO_RGW_STORE asks" \
        "for $store: starting an empty one"
      fresh=1
    elif [ "$store" = memstore ] && ! alive "$dir/osd.pid" && [ ! -f "$dir/osd.clean" ]; then
      say "the memstore OSD of $dir did not stop cleanly: starting an empty cluster"
      fresh=1
    fi
    if [ -n "$fresh" ]; then
      for d in "${daemons[@]}"; do kill_pid "$dir/$d.pid"; done  # its data goes
      create
    else
      write_conf
      alive "$dir/mon.pid" || spawn mon ceph-mon -i a
    fi
    if ! alive "$dir/osd.pid"; then
      rm -f "$dir/osd.clean"
      log_at=$(stat -c %s "$dir/log/osd.0.log" 2>/dev/null || echo 0)
      spawn osd ceph-osd -i 0
      # RGW started before the OSD is up waits for its next objecter tick
      # (5 s) to find it: wait for the OSD's own word that it is active.
      until tail -c +$((log_at + 1)) "$dir/log/osd.0.log" 2>/dev/null |
        grep -q 'state: booting -> active'; do
        for d in mon osd; do running "$dir/$d.pid" || failed "$d exited"; done
        ((SECONDS < deadline)) || failed "the OSD did not come up within $timeout_s s"
        sleep 0.05
      done
    fi
    alive "$dir/radosgw.pid" || spawn radosgw radosgw -n client.rgw.ckptio
    # Ready when the test user's signed requests work: wait for RGW's
    # HTTP port, make the user (idempotent), then the bucket.
    until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 \
      "http://127.0.0.1:$rgw_port/")" != 000 ]; do
      for d in "${daemons[@]}"; do running "$dir/$d.pid" || failed "$d exited"; done
      ((SECONDS < deadline)) || failed "RGW did not answer on port $rgw_port within $timeout_s s"
      sleep 0.1
    done
    admin=(timeout "$(left)" radosgw-admin -c "$conf")
    if ! "${admin[@]}" user info --uid ckptio >/dev/null 2>&1; then
      "${admin[@]}" user create --uid ckptio --display-name "ckptio tests" \
        --access-key "$access_key" --secret "$secret_key" \
        >"$dir/log/user.out" 2>&1 || failed "radosgw-admin user create failed"
    fi
    until code=$(s3 PUT "/$bucket") && [ "$code" = 200 ]; do
      ((SECONDS < deadline)) ||
        failed "creating bucket $bucket answered HTTP $code: $(cat "$dir/log/curl.out")"
      sleep 0.2
    done
    env_lines | tee "$dir/env"
    say "RGW serving http://127.0.0.1:$rgw_port for $dir (radosgw pid $(cat "$dir/radosgw.pid"))"
    ;;
  stop)
    stop_all
    say "stopped $dir"
    ;;
  status)
    alive "$dir/radosgw.pid" && alive "$dir/osd.pid" && alive "$dir/mon.pid"
    ;;
  *)
    say "unknown command $cmd (start, stop, status)"
    exit 2
    ;;
esac
