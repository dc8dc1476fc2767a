// What ckptio's benchmark programs share: timing, dying with a message,
// settling the file system and the page cache the same way before every
// contender, and the tensors as a State.
#ifndef CKPTIO_TOOLS_BENCH_IO_H_
#define CKPTIO_TOOLS_BENCH_IO_H_

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "ckptio/status.h"
#include "ckptio/torch.h"
#include "kernel_touch.h"

namespace ckptio::bench {

inline double Seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

[[noreturn]] inline void Die(const std::string& what) {
  std::cerr << program_invocation_short_name << ": " << what << "\n";
  std::exit(1);
}

inline void Check(const Status& s, const std::string& what) {
  if (!s.ok()) Die(what + ": " + s.ToString());
}

// A buffer for raw reads, through KernelTouch as a reused buffer would be.
inline std::vector<char> ReadBuffer(size_t size) {
  std::vector<char> buf(size);
  KernelTouch(buf.data(), buf.size());
  return buf;
}

// Waits until the file system holding `dir` has written back everything and
// finished its pending work: on a file system mounted with `discard` (this
// VM's ext4) freeing a large file queues TRIMs that the next journal commit,
// the next timed save's fsync, would otherwise pay for.
inline void Settle(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0 || ::syncfs(fd) != 0) Die("syncfs " + dir);
  ::close(fd);
}

// Removes `path` (file or folder), then settles its file system.
inline void RemoveAndSettle(const std::string& path) {
  std::filesystem::remove_all(path);
  Settle(std::filesystem::path(path).parent_path());
}

// Drops the page cache of every file under `path` (written back first).
inline void DropCache(const std::string& path) {
  auto drop = [](const std::filesystem::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY);
    if (fd < 0) return;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  if (std::filesystem::is_regular_file(path)) return drop(path);
  for (const auto& e : std::filesystem::recursive_directory_iterator(path))
    if (e.is_regular_file()) drop(e.path());
}

// The tensors as a State (items t0, t1, ...), referring to `tensors`.
inline State StateOf(std::vector<torch::Tensor>& tensors) {
  State state;
  for (size_t i = 0; i < tensors.size(); ++i)
    state.items.emplace_back("t" + std::to_string(i), tensors[i]);
  return state;
}

}  // namespace ckptio::bench

#endif  // CKPTIO_TOOLS_BENCH_IO_H_
