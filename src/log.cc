#include "ckptio/log.h"

#include <cstdio>
#include <mutex>
#include <string>
#include <utility>

namespace ckptio {
namespace {

std::mutex& SinkMutex() {
  static std::mutex mu;
  return mu;
}

LogSink& Sink() {
  static LogSink sink;
  return sink;
}

}  // namespace

LogSink SetLogSink(LogSink sink) {
  std::lock_guard<std::mutex> g(SinkMutex());
  return std::exchange(Sink(), std::move(sink));
}

void Log(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> g(SinkMutex());
  if (Sink()) {
    Sink()(level, message);
    return;
  }
  const std::string line = std::string("ckptio: ") +
                           (level == LogLevel::kWarning ? "warning: " : "") + std::string(message) +
                           "\n";
  std::fputs(line.c_str(), stderr);
}

}  // namespace ckptio
