// Where ckptio's warnings go. ckptio reports failures as Status values; it
// logs only what a trainer should see although the call succeeded: a step
// skipped because it failed verification, a save made synchronously because
// its staging would not fit, retention that could not delete an old step.
// By default each line goes to stderr as "ckptio: warning: <message>".
//
// Example: route ckptio's warnings into the trainer's own log
//   #include <iostream>
//   ckptio::SetLogSink([](ckptio::LogLevel level, std::string_view message) {
//     std::clog << (level == ckptio::LogLevel::kWarning ? "[warn] " : "[info] ")
//               << "ckptio: " << message << "\n";
//   });
#ifndef CKPTIO_LOG_H_
#define CKPTIO_LOG_H_

#include <functional>
#include <string_view>

#include "ckptio/export.h"

namespace ckptio {

enum class LogLevel { kInfo, kWarning };

using LogSink = std::function<void(LogLevel level, std::string_view message)>;

// Sends every later message to `sink` (null: back to stderr) and returns the
// sink it replaces. Thread-safe; the sink may be called from ckptio's
// threads (a background save's), one message at a time.
CKPTIO_EXPORT LogSink SetLogSink(LogSink sink);

// Hands `message` to the sink.
CKPTIO_EXPORT void Log(LogLevel level, std::string_view message);

}  // namespace ckptio

#endif  // CKPTIO_LOG_H_
