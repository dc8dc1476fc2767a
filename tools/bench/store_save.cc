// ckptio-bench-save / ckptio-bench-save-unhashed: one timed save through
// ckptio::Store, for ckptio-bench's measurement of what checksums cost a
// save (its ChecksumPairs runs the two alternately, as child processes).
//
//   ckptio-bench-save STORE_DIR COUNT BYTES
//
// Makes COUNT buffers of BYTES random bytes each, handed to the kernel once
// (KernelTouch) before timing, opens a writer on the POSIX store at
// STORE_DIR (a fresh one: step 1 must not be committed there), then saves
// the buffers as step 1: one object "tensors", one Write per buffer, as
// Checkpointer::Save writes the loose tensors of a state, committed durably
// (every object fsynced, the manifest, LATEST). Prints the seconds from
// Begin to the end of Commit. Exit 1 (with the error on stderr) if the save
// fails, 2 on bad arguments.
//
// The same source makes both programs: ckptio-bench-save links the ckptio
// libraries; ckptio-bench-save-unhashed is built from the core's sources
// with null_hasher.cc in place of src/hash.cc, so its saves hash nothing
// and what it writes never verifies (tests/bench/store_save_test.sh).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/posix_backend.h"
#include "ckptio/store.h"
#include "kernel_touch.h"

namespace {

[[noreturn]] void Die(const std::string& what, int code = 1) {
  std::fprintf(stderr, "ckptio-bench-save: %s\n", what.c_str());
  std::exit(code);
}

void Check(const ckptio::Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}

[[noreturn]] void Usage() { Die("usage: ckptio-bench-save STORE_DIR COUNT BYTES", 2); }

int64_t Count(const char* text, int64_t max) {
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > max) Usage();
  return v;
}

// Incompressible, different from buffer to buffer (splitmix64).
std::vector<char> RandomBytes(size_t size, uint64_t seed) {
  std::vector<char> out(size);
  uint64_t x = seed;
  for (size_t i = 0; i < size; i += 8) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    for (size_t b = 0; b < 8 && i + b < size; ++b) out[i + b] = static_cast<char>(z >> (8 * b));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) Usage();
  const std::string store_dir = argv[1];
  const int64_t count = Count(argv[2], 100000);
  const int64_t bytes = Count(argv[3], int64_t{1} << 40);
  std::vector<std::vector<char>> buffers;
  for (int64_t i = 0; i < count; ++i) {
    buffers.push_back(RandomBytes(static_cast<size_t>(bytes), static_cast<uint64_t>(i + 1)));
    ckptio::bench::KernelTouch(buffers.back().data(), buffers.back().size());
  }

  auto backend = ckptio::NewPosixBackend(store_dir);
  Check(backend.status(), "open backend");
  ckptio::Store store(std::shared_ptr<ckptio::StorageBackend>(std::move(*backend)));
  auto writer = store.OpenWriter(ckptio::WriterOptions{});
  Check(writer.status(), "open writer");

  const auto t0 = std::chrono::steady_clock::now();
  auto pending = (*writer)->Begin(1);
  Check(pending.status(), "begin step 1");
  auto stream = (*pending)->AddObject("tensors");
  Check(stream.status(), "add object");
  for (const auto& b : buffers) Check((*stream)->Write(b.data(), b.size()), "write");
  Check((*stream)->Close(), "close object");
  auto info = (*pending)->Commit();
  Check(info.status(), "commit");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%.9f\n", secs);
  return 0;
}
