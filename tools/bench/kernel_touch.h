// Memory made ready for the kernel's copies, before a benchmark times them.
//
// On some VMs (seen on a 2-core AMD EPYC Firecracker guest) the kernel's
// first access to each 4 KiB page of a process's memory is slow even after
// the process itself has written the page: writing 256 MiB to tmpfs from a
// buffer never handed to the kernel took 0.45 to 0.60 s, the same write
// again 0.06 to 0.10 s; a 256 MiB read from the page cache into a new,
// zeroed buffer 0.35 s, into the same buffer again 0.02 s. A contender that
// happened to be the first to hand a buffer to the kernel would pay that for
// all the others. Memory that has been through KernelTouch costs every
// contender the same: what a program that reuses its buffers sees.
#ifndef CKPTIO_TOOLS_BENCH_KERNEL_TOUCH_H_
#define CKPTIO_TOOLS_BENCH_KERNEL_TOUCH_H_

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace ckptio::bench {

[[noreturn]] inline void KernelTouchFailed(const char* what) {
  std::perror(what);
  std::exit(1);
}

// Copies [p, p + size) through a pipe and back into place: the kernel reads
// and writes every page once; the bytes are unchanged. Each piece is at most
// what the pipe holds (F_GETPIPE_SZ: 64 KiB by default, less for a user over
// fs.pipe-user-pages-soft), so a write never waits for the reader, which is
// this thread.
inline void KernelTouch(void* p, size_t size) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) KernelTouchFailed("KernelTouch: pipe2");
  (void)::fcntl(fds[1], F_SETPIPE_SZ, 1 << 20);  // fewer round trips where allowed
  const int held = ::fcntl(fds[1], F_GETPIPE_SZ);
  if (held <= 0) KernelTouchFailed("KernelTouch: F_GETPIPE_SZ");
  char* c = static_cast<char*>(p);
  for (size_t off = 0; off < size;) {
    const size_t n = std::min<size_t>(size - off, static_cast<size_t>(held));
    size_t in = 0, out = 0;
    while (in < n) {
      const ssize_t w = ::write(fds[1], c + off + in, n - in);
      if (w < 0 && errno != EINTR) KernelTouchFailed("KernelTouch: write to the pipe");
      if (w > 0) in += static_cast<size_t>(w);
    }
    while (out < n) {
      const ssize_t r = ::read(fds[0], c + off + out, n - out);
      if (r < 0 && errno != EINTR) KernelTouchFailed("KernelTouch: read from the pipe");
      if (r == 0) {
        errno = EPIPE;
        KernelTouchFailed("KernelTouch: the pipe ended early");
      }
      if (r > 0) out += static_cast<size_t>(r);
    }
    off += n;
  }
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace ckptio::bench

#endif  // CKPTIO_TOOLS_BENCH_KERNEL_TOUCH_H_
