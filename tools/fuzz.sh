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
objs=()
for src in "${core[@]}"; do
  o=$out/$src.o
  if [ ! -f "$o" ] || [ "$root/src/$src.cc" -nt "$o" ] || [ -n "$(find "$root/include" "$root/src" \( -name '*.h' -o -name '*.inc' \) -newer "$o" 2>/dev/null)" ]; then
    # shellcheck disable=SC2046  # no flags, or one
    $cxx "${flags[@]/-fsanitize=fuzzer,/-fsanitize=fuzzer-no-link,}" $(isa_flags "$src") -c "$root/src/$src.cc" -o "$o"
  fi
  objs+=("$o")
done

passed=0
for t in "${targets[@]}"; do
  exe=$out/fuzz_$t
  if [ ! -x "$exe" ] || [ "$root/tests/fuzz/fuzz_$t.cc" -nt "$exe" ] || [ -n "$(find "${objs[@]}" -newer "$exe")" ]; then
    $cxx "${flags[@]}" "$root/tests/fuzz/fuzz_$t.cc" "${objs[@]}" -o "$exe"
  fi
  work=$(mktemp -d)
  cp -r "$root/tests/fuzz/corpus/$t/." "$work/"
  log=$out/fuzz_$t.log
  rm -f "$out"/crash-"$t"-*  # every artifact of this target (crash, leak, timeout, oom)
  if "$exe" "$work" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$out/crash-$t-" -print_final_stats=1 >"$log" 2>&1; then
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    echo "fuzz $t: ${runs:-?} inputs in ${seconds}s, no crash, leak or hang"
    passed=$((passed + 1))
  else
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
  fi
  rm -rf "$work"
done
echo "fuzz: $passed passed, $(( ${#targets[@]} - passed )) failed"
[ "$passed" = ${#targets[@]} ]
