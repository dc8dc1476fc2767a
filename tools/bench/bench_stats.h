// What ckptio-bench makes of its timings: each contender's spread over its
// runs, and the sanity checks that decide whether a run's ratios mean
// anything (a run that fails one prints no ratios; see docs/PERFORMANCE.md).
#ifndef CKPTIO_TOOLS_BENCH_STATS_H_
#define CKPTIO_TOOLS_BENCH_STATS_H_

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace ckptio::bench {

// A contender whose runs span more than this share of their median is
// flagged noisy: its median says little on its own.
inline constexpr double kNoisySpread = 0.25;
// A warm load may be this much slower than its cold twin before the run is
// called broken (timer and scheduler jitter on loads of a few milliseconds).
inline constexpr double kWarmSlack = 0.10;

struct Summary {
  double min = 0, median = 0, max = 0;
  double spread = 0;  // (max - min) / median; 0 for one run
  bool noisy = false;
};

inline Summary Summarize(std::vector<double> runs) {
  Summary s;
  if (runs.empty()) return s;
  std::sort(runs.begin(), runs.end());
  s.min = runs.front();
  s.max = runs.back();
  s.median = runs[runs.size() / 2];
  s.spread = s.median > 0 ? (s.max - s.min) / s.median : 0;
  s.noisy = s.spread > kNoisySpread;
  return s;
}

// Why one shape's timings (contender -> seconds of each run) cannot be
// trusted; empty when they can. Checked where both contenders ran:
//   * a warm load slower than its cold twin (the same load after the page
//     cache was dropped) by more than their noise (the larger spread of the
//     two, at least kWarmSlack): the warm path, or the measurement, pays
//     for something it should not;
//   * two contenders that do the same work (an in-process save and the same
//     save by a child process) whose best runs are more than kNoisySpread
//     apart: what ran before one of them changed its time. Best against
//     best, because noise only adds time: on a disk whose saves come either
//     fast or two to three times slower, run to run, the medians of three
//     runs of the same save differ by chance, where a cost that one
//     contender pays every time moves its best run too.
inline std::vector<std::string> SanityFailures(
    const std::map<std::string, std::vector<double>>& timings) {
  std::vector<std::string> out;
  auto runs = [&](const std::string& name) -> const std::vector<double>* {
    auto it = timings.find(name);
    return it == timings.end() || it->second.empty() ? nullptr : &it->second;
  };
  auto fmt = [](const char* f, auto... args) {
    char buf[256];
    std::snprintf(buf, sizeof buf, f, args...);
    return std::string(buf);
  };
  for (const char* warm : {"raw_read", "ckptio_load", "torch_load", "python_load"}) {
    const std::string cold = std::string(warm) + "_cold";
    const auto* w = runs(warm);
    const auto* c = runs(cold);
    if (!w || !c) continue;
    const Summary sw = Summarize(*w), sc = Summarize(*c);
    const double noise = std::max({kWarmSlack, sw.spread, sc.spread});
    if (sw.median > sc.median * (1 + noise))
      out.push_back(
          fmt("%s (warm, median %.4f s) is slower than %s (median %.4f s) by more "
              "than their noise (%.0f %%)",
              warm, sw.median, cold.c_str(), sc.median, 100 * noise));
  }
  const std::pair<const char*, const char*> same[] = {{"ckptio_save", "ckptio_save_hashed"}};
  for (const auto& [a, b] : same) {
    const auto* va = runs(a);
    const auto* vb = runs(b);
    if (!va || !vb) continue;
    const Summary sa = Summarize(*va), sb = Summarize(*vb);
    const double lo = std::min(sa.min, sb.min), hi = std::max(sa.min, sb.min);
    if (lo > 0 && hi / lo - 1 > kNoisySpread)
      out.push_back(
          fmt("%s (best %.4f s) and %s (best %.4f s) do the same work but their best "
              "runs differ by %.0f %%, more than the noise allowed (%.0f %%)",
              a, sa.min, b, sb.min, 100 * (hi / lo - 1), 100 * kNoisySpread));
  }
  return out;
}

}  // namespace ckptio::bench

#endif  // CKPTIO_TOOLS_BENCH_STATS_H_
