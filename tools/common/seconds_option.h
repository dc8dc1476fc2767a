// A command-line option that counts seconds.
#ifndef CKPTIO_TOOLS_COMMON_SECONDS_OPTION_H_
#define CKPTIO_TOOLS_COMMON_SECONDS_OPTION_H_

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <sstream>
#include <string>

namespace ckptio {

// Seconds from `lo` to `hi`. CLI::Range lets "nan" through (no comparison
// with it is true), and a NaN or huge wait overflows a deadline.
inline CLI::Validator Seconds(double lo, double hi) {
  std::ostringstream os;
  os << lo << " to " << hi;
  const std::string range = os.str();
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0' || !(v >= lo && v <= hi))
          return "expected seconds from " + range + ", got \"" + text + "\"";
        return {};
      },
      "SECONDS in [" + range + "]");
}

}  // namespace ckptio

#endif  // CKPTIO_TOOLS_COMMON_SECONDS_OPTION_H_
