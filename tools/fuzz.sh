#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan +
# libFuzzer) into ./build-fuzz and runs each for CKPTIO_FUZZ_SECONDS
# (default 15) from the seed corpus in tests/fuzz/corpus. Fails on any
# crash, leak, timeout or out-of-memory. Usage: tools/fuzz.sh [TARGET...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$root/build-fuzz
seconds=${CKPTIO_FUZZ_SECONDS:-15}
mkdir -p "$out"
cxx="clang++"
command -v ccache >/dev/null && cxx="ccache clang++"
flags=(-std=c++17 -g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=all -I"$root/include" -I"$root/src")
# Every core source (src/*.cc: the core, never the torch adapter in src/torch).
# The XXH3 kernels for wider vector units are built for their instruction
# set, as src/CMakeLists.txt builds them, and only on x86-64.
core=()
for f in "$root"/src/*.cc; do
  case $(basename "$f") in
    xxh3_avx2.cc | xxh3_avx512.cc) [ "$(uname -m)" = x86_64 ] || continue ;;
  esac
  core+=("$(basename "$f" .cc)")
done
isa_flags() {
  case $1 in
    xxh3_avx2) echo -mavx2 ;;
    xxh3_avx512) echo -mavx512f ;;
  esac
}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(manifest records names safetensors json)

# Objects of the core sources the targets need, rebuilt only when changed.
# At most one compiler or fuzzer per core at a time: pool_wait blocks until
# fewer than nproc of this script's jobs run.
slots=$(nproc)
pool_wait() {
  while [ "$(jobs -rp | wc -l)" -ge "$slots" ]; do wait -n || true; done
}

# The core's objects, compiled in parallel (each job's status is checked
# below, through its pid).
objs=() pids=()
for src in "${core[@]}"; do
  o=$out/$src.o
  if [ ! -f "$o" ] || [ "$root/src/$src.cc" -nt "$o" ] || [ -n "$(find "$root/include" "$root/src" \( -name '*.h' -o -name '*.inc' \) -newer "$o" 2>/dev/null)" ]; then
    pool_wait
    # shellcheck disable=SC2046  # no flags, or one
    $cxx "${flags[@]/-fsanitize=fuzzer,/-fsanitize=fuzzer-no-link,}" $(isa_flags "$src") -c "$root/src/$src.cc" -o "$o" &
    pids+=($!)
  fi
  objs+=("$o")
done
for pid in "${pids[@]}"; do
  wait "$pid" || { echo "fuzz: a core source did not compile (above)"; exit 1; }
done

# fuzz_one TARGET: builds the target and runs it; its verdict goes to
# $out/fuzz_TARGET.result, written once the run is over: a last line
# "fuzz TARGET: ... no crash, leak or hang" for a pass, anything else (no
# file included) is a failure.
fuzz_one() {
  local t=$1
  local exe=$out/fuzz_$t result=$out/fuzz_$t.result build_log=$out/fuzz_$t.build.log
  if [ ! -x "$exe" ] || [ "$root/tests/fuzz/fuzz_$t.cc" -nt "$exe" ] || [ -n "$(find "${objs[@]}" -newer "$exe")" ]; then
    if ! $cxx "${flags[@]}" "$root/tests/fuzz/fuzz_$t.cc" "${objs[@]}" -o "$exe" >"$build_log" 2>&1; then
      { cat "$build_log"; echo "fuzz $t: FAILED (the target did not build: above)"; } >"$result"
      return
    fi
  fi
  local work log=$out/fuzz_$t.log
  work=$(mktemp -d)
  cp -r "$root/tests/fuzz/corpus/$t/." "$work/"
  rm -f "$out"/crash-"$t"-*  # every artifact of this target (crash, leak, timeout, oom)
  if "$exe" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$out/crash-$t-" -print_final_stats=1 >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz $t: ${runs:-?} inputs in ${seconds}s, no crash, leak or hang" >"$result"
  else
    {
      tail -40 "$log"
      repro=$(ls "$out"/crash-"$t"-* 2>/dev/null | head -1 || true)
      # The seed and the input itself, so that a failure on a CI machine can be
      # replayed elsewhere: base64 -d > x; build-fuzz/fuzz_TARGET x.
      seed=$(sed -n 's/^INFO: Seed: //p' "$log" | head -1 || true)
      if [ -n "$repro" ]; then
        if [ "$(stat -c %s "$repro")" -le 16384 ]; then
          echo "fuzz $t: the input, base64: $(base64 -w0 "$repro")"
        else
          echo "fuzz $t: the input is over 16 KiB, not printed"
        fi
      fi
      echo "fuzz $t: FAILED (libFuzzer -seed=${seed:-?}; reproducer: ${repro:-none written})"
    } >"$result"
  fi
  rm -rf "$work"
}

# The targets, as many at a time as there are cores (each fuzzer runs on one
# thread); their verdicts printed in order.
for t in "${targets[@]}"; do
  rm -f "$out/fuzz_$t.result"
  pool_wait
  fuzz_one "$t" &
done
wait
passed=0
for t in "${targets[@]}"; do
  result=$out/fuzz_$t.result
  if [ ! -f "$result" ]; then
    echo "fuzz $t: FAILED (no verdict: the job died)"
    continue
  fi
  cat "$result"
  if tail -1 "$result" | grep -q "^fuzz $t: .* no crash, leak or hang$"; then
    passed=$((passed + 1))
  fi
done
echo "fuzz: $passed passed, $(( ${#targets[@]} - passed )) failed"
[ "$passed" = ${#targets[@]} ]
