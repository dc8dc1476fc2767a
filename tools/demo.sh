#!/usr/bin/env bash
# The main job (until the DDP trainer lands): an end-to-end walk through the
# CLI on ./demo-store. Writes checkpoints, corrupts one on purpose, shows
# `ckptio verify` catching it and `ckptio fsck --repair` recovering.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

bin=$BUILD_DIR/bin
store=${DEMO_STORE:-$CKPTIO_ROOT/demo-store}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { echo "\$ $*"; "$@"; }

rm -rf "$store"
say "1. Write four checkpoints (3 objects x 6 MiB each), keeping the newest 3"
run "$bin/ckptio-gen" "$store" --steps 4 --every 500 --objects 3 --size 6M --keep 3
run "$bin/ckptio" ls "$store"

say "2. Everything verifies"
run "$bin/ckptio" verify "$store" --all

victim=$(ls -d "$store"/step-* | tail -1)/shard-1.bin
say "3. Flip one bit in the newest checkpoint: $victim, byte 5000000"
printf '\x01' | dd of="$victim" bs=1 seek=5000000 count=1 conv=notrunc status=none

say "4. verify finds it (exit 1) and names the object and byte range"
set +e
run "$bin/ckptio" verify "$store" --all
rc=$?
set -e
echo "exit code: $rc"
[ "$rc" = 1 ] || { echo "demo: expected verify to exit 1" >&2; exit 1; }

say "5. fsck reports the damage and a LATEST that names a bad step"
set +e
run "$bin/ckptio" fsck "$store"
set -e

say "6. fsck --repair: LATEST moves to the newest good step, the corrupt one is retired"
run "$bin/ckptio" fsck "$store" --repair
run "$bin/ckptio" ls "$store"
run "$bin/ckptio" verify "$store"

say "7. Training resumes: the next checkpoint commits on top of the repaired store"
run "$bin/ckptio-gen" "$store" --steps 1 --objects 3 --size 6M --keep 3
run "$bin/ckptio" verify "$store" --all
run "$bin/ckptio" inspect "$store" latest
echo
echo "demo: done (store left in $store)"
