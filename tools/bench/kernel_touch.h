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
#include <cstddef>
#include <cstdio>
#include <cstdlib>

namespace ckptio::bench {

// Copies [p, p + size) through a pipe and back into place: the kernel reads
// and writes every page once; the bytes are unchanged.
inline void KernelTouch(void* p, size_t size) {
  int fds[2];
  if (::pipe(fds) != 0) {
    std::perror("KernelTouch: pipe");
    std::exit(1);
  }
  char* c = static_cast<char*>(p);
  // 64 KiB pieces: a pipe holds that much without a reader by default.
  for (size_t off = 0; off < size;) {
    const size_t n = std::min<size_t>(size - off, 64 << 10);
    if (::write(fds[1], c + off, n) != static_cast<ssize_t>(n) ||
        ::read(fds[0], c + off, n) != static_cast<ssize_t>(n)) {
      std::perror("KernelTouch: pipe round trip");
      std::exit(1);
    }
    off += n;
  }
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace ckptio::bench

#endif  // CKPTIO_TOOLS_BENCH_KERNEL_TOUCH_H_
