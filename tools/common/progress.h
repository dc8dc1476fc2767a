// A progress bar on stderr for the command-line tools, drawn only when stderr
// is a terminal (nothing when it is piped or logged).
#ifndef CKPTIO_TOOLS_COMMON_PROGRESS_H_
#define CKPTIO_TOOLS_COMMON_PROGRESS_H_

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "ckptio/store.h"
#include "text.h"

namespace ckptio {

class Progress {
 public:
  explicit Progress(uint64_t total) : total_(total), enabled_(::isatty(2) && total > 0) {}
  ~Progress() { Done(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Clears the bar; call before printing results.
  void Done() {
    if (enabled_ && drawn_) std::cerr << "\r\033[K" << std::flush;
    enabled_ = false;
  }
  ProgressFn Fn() {
    return [this](uint64_t n) { Add(n); };
  }
  void Add(uint64_t n) {
    done_ += n;
    total_ = std::max(total_, done_);  // more than expected (gc read past a corrupt step)
    if (!enabled_) return;
    auto now = std::chrono::steady_clock::now();
    if (drawn_ && now - last_ < std::chrono::milliseconds(100) && done_ < total_) return;
    last_ = now;
    drawn_ = true;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done_ / total_);
    char percent[8];
    std::snprintf(percent, sizeof percent, "%3d%%", static_cast<int>(100 * done_ / total_));
    std::cerr << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, ' ') << "] "
              << percent << ' ' << HumanBytes(done_) << " / " << HumanBytes(total_) << std::flush;
  }

 private:
  uint64_t total_;
  uint64_t done_ = 0;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace ckptio

#endif  // CKPTIO_TOOLS_COMMON_PROGRESS_H_
