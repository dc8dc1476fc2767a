#!/usr/bin/env bash
# tools/rgw-server.sh as the S3 tests will use it, on a real Ceph cluster:
# a cold start, SigV4-signed requests, the conditional create a commit on
# an object store relies on (PUT with If-None-Match: * answers 412 once the
# key exists), radosgw SIGKILLed and brought back with the data intact, and
# a stop that leaves no daemon of it behind.
#
#   rgw_server_test.sh SOURCE_DIR SCRATCH_DIR
set -euo pipefail
src=$1
dir=$2
server=$src/tools/rgw-server.sh
if ! command -v radosgw >/dev/null || ! command -v ceph-mon >/dev/null; then
  echo "SKIP: Ceph's radosgw and ceph-mon are not installed (tools/setup.sh installs them)"
  exit 77
fi
rm -rf "$dir"
trap '"$server" stop "$dir" >/dev/null 2>&1 || true' EXIT
fail() {
  echo "FAIL: $*"
  exit 1
}

"$server" start "$dir" >/dev/null || fail "start"
set -a
# shellcheck disable=SC1091
. "$dir/env"
set +a
# s3 METHOD KEY [CURL ARGS...]: prints the HTTP status; the body goes to $dir/body.
s3() {
  local method=$1 key=$2
  shift 2
  curl -sS -o "$dir/body" -w '%{http_code}' --max-time 10 \
    --aws-sigv4 "aws:amz:$AWS_REGION:s3" --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
    -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" -X "$method" "$@" \
    "$AWS_ENDPOINT_URL/$CKPTIO_S3_BUCKET/$key"
}

head -c 100000 /dev/urandom >"$dir/payload"
[ "$(s3 PUT step-1/MANIFEST.json -H 'If-None-Match: *' --data-binary @"$dir/payload")" = 200 ] ||
  fail "the first conditional PUT: $(cat "$dir/body")"
code=$(s3 PUT step-1/MANIFEST.json -H 'If-None-Match: *' --data-binary "a second writer")
[ "$code" = 412 ] || fail "a second conditional PUT of the same key answered $code, not 412"
{ [ "$(s3 GET step-1/MANIFEST.json)" = 200 ] && cmp -s "$dir/body" "$dir/payload"; } ||
  fail "GET did not return the first writer's bytes"
code=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 \
  --aws-sigv4 "aws:amz:$AWS_REGION:s3" --user "$AWS_ACCESS_KEY_ID:wrong-secret" \
  -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$AWS_ENDPOINT_URL/$CKPTIO_S3_BUCKET/step-1/MANIFEST.json")
[ "$code" = 403 ] || fail "a request signed with the wrong secret answered $code, not 403"

kill -KILL "$(cat "$dir/radosgw.pid")"
for _ in $(seq 50); do "$server" status "$dir" || break; sleep 0.1; done
! "$server" status "$dir" || fail "status still says running after radosgw was killed"
"$server" start "$dir" >/dev/null || fail "start after radosgw was killed"
{ [ "$(s3 GET step-1/MANIFEST.json)" = 200 ] && cmp -s "$dir/body" "$dir/payload"; } ||
  fail "the object is gone or changed after radosgw was killed and restarted"

"$server" stop "$dir" 2>/dev/null || fail "stop"
left=$(pgrep -f -- "-c $dir/ceph.conf" || true)
[ -z "$left" ] || fail "daemons left running after stop: $left"
trap - EXIT
echo "PASS: rgw-server start, conditional create, kill and restart, stop"
