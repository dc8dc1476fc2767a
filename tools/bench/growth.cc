// ckptio-bench-growth: what a save, a load, a verify and an asynchronous
// save cost as the state grows, and how much memory a save and a load take
// beyond the state. One state per run, so that each starts with the memory
// of a fresh process; tools/bench/growth.sh runs the sizes and tensor
// counts of docs/PERFORMANCE.md's growth table and prints it.
//
//   ckptio-bench-growth --dir DIR (--size MiB | --tensors N) [--repeat R]
//                       [--json FILE] [--row]
//
// --size: 8 float tensors of MiB/8 each; --tensors: N tensors of 4 KiB.
// Measured, each --repeat times (median, min, max):
//   save        Checkpointer::Save into an empty store (durable, committed)
//   async_stall how long SaveAsync blocks the caller, staging memory reused
//               from an untimed first save (a state over max_staging_bytes
//               is saved synchronously: one run, flagged)
//   verify      every object of the step read and checked (warm page cache)
//   load        Checkpointer::Load onto the CPU, verified (warm)
//   load_cold   the same after the store's page cache was dropped
// and, from /proc/self/status (peak reset through /proc/self/clear_refs):
//   save_peak_extra  the most the process's resident memory grew during a
//                    save (the largest of the runs)
//   load_peak_extra  the same during a load, which maps the step: the state's
//                    own pages count (the tensors share the map), so "no
//                    second copy" is load_peak_extra <= the state + a little
//   load_anon_extra  private memory a load left allocated (a copy of the
//                    state would show here)
// The source tensors are freed before the verifies and loads.
#include <sys/statvfs.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "bench_io.h"
#include "bench_stats.h"
#include "ckptio/torch.h"

namespace {

using ckptio::bench::Check;
using ckptio::bench::Die;
using ckptio::bench::DropCache;
using ckptio::bench::RemoveAndSettle;
using ckptio::bench::Seconds;
using ckptio::bench::Settle;
using ckptio::bench::StateOf;
using json = nlohmann::json;

// Resident memory of this process, in bytes (/proc/self/status).
struct Memory {
  uint64_t rss = 0, peak = 0, anon = 0;
};

Memory ReadMemory() {
  std::ifstream in("/proc/self/status");
  Memory m;
  std::string key;
  uint64_t kib = 0;
  while (in >> key) {
    if (key == "VmRSS:" && in >> kib) m.rss = kib << 10;
    if (key == "VmHWM:" && in >> kib) m.peak = kib << 10;
    if (key == "RssAnon:" && in >> kib) m.anon = kib << 10;
  }
  if (m.rss == 0 || m.peak == 0) Die("no VmRSS / VmHWM in /proc/self/status");
  return m;
}

// Sets the peak (VmHWM) to the current resident memory.
void ResetPeak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  if (!out) Die("cannot reset the peak through /proc/self/clear_refs (Linux 4.0 or later)");
}

uint64_t AvailableMemory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (in >> key)
    if (key == "MemAvailable:" && in >> kib) return kib << 10;
  Die("no MemAvailable in /proc/meminfo");
}

// `count` float tensors of `elems` each, filled fast (a 16 GiB state by
// torch::randn would take minutes): a xorshift stream, content irrelevant
// to the timings (nothing is compressed).
std::vector<torch::Tensor> MakeState(int64_t count, int64_t elems) {
  std::vector<torch::Tensor> out;
  uint64_t x = 0x9e3779b97f4a7c15ULL;
  for (int64_t i = 0; i < count; ++i) {
    torch::Tensor t = torch::empty({elems}, torch::kFloat32);
    auto* p = static_cast<uint32_t*>(t.data_ptr());
    for (int64_t j = 0; j < elems; ++j) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      p[j] = static_cast<uint32_t>(x >> 41) | 0x3f800000u;  // floats in [1, 2)
    }
    ckptio::bench::KernelTouch(p, t.nbytes());
    out.push_back(std::move(t));
  }
  return out;
}

std::unique_ptr<ckptio::Checkpointer> Open(const std::string& store,
                                           ckptio::CheckpointerOptions o = {}) {
  auto c = ckptio::Checkpointer::Open(store, ckptio::RankInfo{}, std::move(o));
  if (!c.ok()) Die(c.status().ToString());
  return std::move(*c);
}

std::string Mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckptio-bench-growth: save, load, verify and async stall of one state size"};
  std::string dir, json_path;
  int64_t size_mib = 0, tensors = 0;
  int repeat = 3;
  bool row = false;
  app.add_option("--dir", dir, "scratch folder (its file system is what is measured)")->required();
  auto* size_opt = app.add_option("--size", size_mib, "MiB of state in 8 float tensors")
                       ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--tensors", tensors, "this many 4 KiB float tensors instead")
      ->check(CLI::Range(int64_t{1}, int64_t{10'000'000}))
      ->excludes(size_opt);
  app.add_option("--repeat", repeat, "runs of each measurement")->check(CLI::Range(1, 100));
  app.add_option("--json", json_path, "write the numbers here");
  app.add_flag("--row", row, "print one Markdown row of the growth table (tools/bench/growth.sh)");
  CLI11_PARSE(app, argc, argv);
  if ((size_mib == 0) == (tensors == 0)) Die("give --size or --tensors");
  torch::set_num_threads(1);

  const int64_t count = tensors ? tensors : 8;
  const int64_t elems = tensors ? 1024 : (size_mib << 20) / 8 / 4;
  const uint64_t bytes = static_cast<uint64_t>(count * elems * 4);
  const double gib = static_cast<double>(bytes) / (1 << 30);
  const ckptio::CheckpointerOptions defaults;
  // SaveAsync stages a copy of the state up to max_staging_bytes; beyond,
  // it saves synchronously.
  const bool stages = bytes <= defaults.max_staging_bytes;
  constexpr uint64_t kMargin = uint64_t{1} << 30;
  if (bytes + (stages ? bytes : 0) + kMargin > AvailableMemory())
    Die("a state of " + Mib(bytes) + " MiB" + (stages ? " and its staging copy" : "") +
        " does not fit in the " + Mib(AvailableMemory()) +
        " MiB of available memory with 1 GiB to spare: pick a smaller --size");
  std::filesystem::create_directories(dir);
  struct statvfs v;
  if (::statvfs(dir.c_str(), &v) != 0) Die("statvfs " + dir);
  const uint64_t free_disk = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  // The async store keeps its previous step while it writes the next.
  if (2 * bytes + kMargin > free_disk)
    Die(dir + " has " + Mib(free_disk) + " MiB free; two steps of " + Mib(bytes) +
        " MiB and 1 GiB to spare are needed: pick a smaller --size or another --dir");

  const std::string store = dir + "/growth-store", async_store = dir + "/growth-async";
  RemoveAndSettle(store);
  RemoveAndSettle(async_store);
  std::map<std::string, std::vector<double>> t;
  uint64_t save_peak_extra = 0, load_peak_extra = 0;
  int64_t load_anon_extra = 0;
  {
    std::vector<torch::Tensor> source = MakeState(count, elems);
    ckptio::State state = StateOf(source);
    for (int r = 0; r < repeat; ++r) {
      RemoveAndSettle(store);
      auto ckpt = Open(store);
      ResetPeak();
      const Memory before = ReadMemory();
      t["save"].push_back(Seconds([&] { Check(ckpt->Save(1, state), "save to " + store); }));
      save_peak_extra = std::max(save_peak_extra, ReadMemory().peak - before.rss);
    }
    {
      ckptio::CheckpointerOptions o;
      o.keep_last = 1;
      auto ckpt = Open(async_store, o);
      if (stages) Check(ckpt->SaveAsync(0, state).get(), "SaveAsync (the untimed first)");
      for (int r = 0; r < (stages ? repeat : 1); ++r) {
        std::future<ckptio::Status> done;
        t["async_stall"].push_back(Seconds([&] { done = ckpt->SaveAsync(r + 1, state); }));
        Check(done.get(), "SaveAsync");
        Settle(dir);  // the save's writeback and its predecessor's removal done
      }
    }  // the staging memory goes with the Checkpointer
    RemoveAndSettle(async_store);
  }  // and the source tensors here

  auto ckpt = Open(store);
  auto verify = [&] {
    auto reader = ckpt->store().OpenStep(1);
    if (!reader.ok()) Die(reader.status().ToString());
    Check((*reader)->Verify(), "verify of " + store);
  };
  verify();  // untimed: the step in the page cache, as after a save that fits
  for (int r = 0; r < repeat; ++r) t["verify"].push_back(Seconds(verify));
  ckptio::LoadOptions lo;
  lo.map_location = ckptio::MapLocation::To("cpu");
  for (const bool cold : {false, true})
    for (int r = 0; r < repeat; ++r) {
      if (cold) DropCache(store);
      std::vector<torch::Tensor> targets;  // untouched: no resident pages yet
      for (int64_t i = 0; i < count; ++i) targets.push_back(torch::empty({elems}));
      ckptio::State state = StateOf(targets);
      ResetPeak();
      const Memory before = ReadMemory();
      t[cold ? "load_cold" : "load"].push_back(Seconds([&] {
        auto loaded = ckpt->Load(state, lo);
        if (!loaded.ok()) Die("load from " + store + ": " + loaded.status().ToString());
        if (loaded->step != 1) Die("load from " + store + " found no step 1");
      }));
      const Memory after = ReadMemory();
      load_peak_extra = std::max(load_peak_extra, after.peak - before.rss);
      load_anon_extra = std::max(
          load_anon_extra, static_cast<int64_t>(after.anon) - static_cast<int64_t>(before.anon));
    }
  ckpt.reset();
  RemoveAndSettle(store);

  json out = {{"state_bytes", bytes},
              {"tensors", count},
              {"repeat", repeat},
              {"async_synchronous", !stages},
              {"save_peak_extra_bytes", save_peak_extra},
              {"load_peak_extra_bytes", load_peak_extra},
              {"load_anon_extra_bytes", load_anon_extra}};
  std::printf("%s MiB in %" PRId64 " tensors, %d runs each\n", Mib(bytes).c_str(), count, repeat);
  for (const auto& [name, runs] : t) {
    const ckptio::bench::Summary s = ckptio::bench::Summarize(runs);
    out[name] = {{"seconds", s.median}, {"min", s.min}, {"max", s.max}, {"noisy", s.noisy}};
    std::printf("  %-12s median %8.4f s  (min %.4f, max %.4f)%s  ", name.c_str(), s.median, s.min,
                s.max, s.noisy ? "  noisy" : "");
    if (tensors)
      std::printf("%.2f us/tensor\n", 1e6 * s.median / static_cast<double>(count));
    else
      std::printf("%.4f s/GiB\n", s.median / gib);
  }
  std::printf("  save: peak memory beyond the state %s MiB\n", Mib(save_peak_extra).c_str());
  std::printf("  load: peak memory %s MiB (the state: %s MiB), private memory left %s MiB\n",
              Mib(load_peak_extra).c_str(), Mib(bytes).c_str(),
              Mib(std::max<int64_t>(load_anon_extra, 0)).c_str());
  if (!stages)
    std::printf("  async_stall: over max_staging_bytes (%s MiB): SaveAsync saved synchronously\n",
                Mib(defaults.max_staging_bytes).c_str());
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  if (row) {
    // | state | tensors | save | async stall | verify | load | cold load | memory |
    auto cell = [&](const std::string& name) {
      const double s = out[name]["seconds"].get<double>();
      char buf[96];
      if (tensors)
        std::snprintf(buf, sizeof buf, "%.3f s (%.1f us/tensor)", s,
                      1e6 * s / static_cast<double>(count));
      else
        std::snprintf(buf, sizeof buf, "%.3f s (%.3f s/GiB)", s, s / gib);
      return std::string(buf);
    };
    std::ostringstream line;
    const std::string state_size = bytes < (1 << 20) ? std::to_string(bytes >> 10) + " KiB"
                                   : tensors         ? Mib(bytes) + " MiB"
                                                     : std::to_string(size_mib) + " MiB";
    line << "| " << state_size << " | " << count << " | " << cell("save") << " | "
         << cell("async_stall") << (stages ? "" : " (synchronous)") << " | " << cell("verify")
         << " | " << cell("load") << " | " << cell("load_cold") << " | " << Mib(save_peak_extra)
         << " / " << Mib(load_peak_extra) << " / " << Mib(std::max<int64_t>(load_anon_extra, 0))
         << " |";
    std::printf("ROW %s\n", line.str().c_str());
  }
  return 0;
}
