// ckptio-gen: writes a few checkpoints of pseudo-random objects, through the
// same commit protocol a trainer uses. For demos and tests.
#include <CLI/CLI.hpp>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "ckptio/ckptio.h"
#include "text.h"

namespace {

// "64M", "4KiB", "1g", "123" -> bytes.
bool ParseSize(const std::string& text, uint64_t* out) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  std::string unit = text.substr(used);
  uint64_t mult = 1;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "K" || unit == "k" || unit == "KiB")
    mult = 1ull << 10;
  else if (unit == "M" || unit == "m" || unit == "MiB")
    mult = 1ull << 20;
  else if (unit == "G" || unit == "g" || unit == "GiB")
    mult = 1ull << 30;
  else
    return false;
  *out = v * mult;
  return true;
}

int Run(int argc, char** argv) {
  CLI::App app{"ckptio-gen: write checkpoints of pseudo-random objects into a store"};
  std::string uri, size_text = "4M";
  int steps = 3, objects = 3, keep = 0;
  int64_t every = 100, start = -1;
  uint64_t seed = 1;
  app.add_option("STORE", uri, "store URI or path")->required();
  app.add_option("--steps", steps, "checkpoints to write")->check(CLI::Range(1, 100000));
  app.add_option("--every", every, "step distance between checkpoints")
      ->check(CLI::Range(int64_t{1}, int64_t{1000000000}));
  app.add_option("--start", start, "first step (default: after LATEST, or 0)");
  app.add_option("--objects", objects, "objects per checkpoint")->check(CLI::Range(1, 10000));
  app.add_option("--size", size_text, "bytes per object, e.g. 512K, 8M, 1G");
  app.add_option("--keep", keep, "keep_last retention (0 keeps all)")->check(CLI::Range(0, 100000));
  app.add_option("--seed", seed, "random seed");
  CLI11_PARSE(app, argc, argv);

  uint64_t size = 0;
  if (!ParseSize(size_text, &size)) {
    std::cerr << "ckptio-gen: --size: expected a number with an optional K, M or G suffix\n";
    return 2;
  }
  auto store = ckptio::OpenStore(uri);
  if (!store.ok()) {
    std::cerr << "ckptio-gen: " << store.status() << "\n";
    return 1;
  }
  if (start < 0) {
    auto latest = (*store)->ReadLatest();
    start = latest.ok() && latest->has_value() ? (*latest)->step + every : 0;
  }
  ckptio::WriterOptions wo;
  wo.keep_last = keep;
  auto writer = (*store)->OpenWriter(wo);
  if (!writer.ok()) {
    std::cerr << "ckptio-gen: " << writer.status() << "\n";
    return 1;
  }
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> block(1 << 17);  // 1 MiB of random words, refreshed per block
  for (int i = 0; i < steps; ++i) {
    int64_t step = start + i * every;
    auto pending = (*writer)->Begin(step);
    ckptio::Status s = pending.status();
    for (int o = 0; s.ok() && o < objects; ++o) {
      auto stream = (*pending)->AddObject("shard-" + std::to_string(o) + ".bin");
      if (!stream.ok()) {
        s = stream.status();
        break;
      }
      for (uint64_t done = 0; s.ok() && done < size;) {
        for (auto& w : block) w = rng();
        size_t n = static_cast<size_t>(std::min<uint64_t>(size - done, block.size() * 8));
        s = (*stream)->Write(block.data(), n);
        done += n;
      }
      if (s.ok()) s = (*stream)->Close();
    }
    if (s.ok()) s = (*pending)->SetMetadata("generator", "ckptio-gen seed " + std::to_string(seed));
    if (s.ok()) s = (*pending)->SetMetadata("step", std::to_string(step));
    if (!s.ok()) {
      std::cerr << "ckptio-gen: step " << step << ": " << s << "\n";
      return 1;
    }
    auto info = (*pending)->Commit();
    if (!info.ok()) {
      std::cerr << "ckptio-gen: " << info.status() << "\n";
      return 1;
    }
    std::cout << "committed step " << step << " (" << objects << " objects, "
              << ckptio::HumanBytes(info->bytes) << ")";
    for (int64_t r : info->retired) std::cout << ", retired step " << r;
    std::cout << "\n";
    if (!info->retention.ok()) std::cerr << "ckptio-gen: warning: " << info->retention << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {  // a bug: ckptio reports errors as Status
    std::cerr << "ckptio-gen: internal error: " << e.what() << "\n";
    return 1;
  }
}
