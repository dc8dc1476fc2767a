// Small text helpers shared by the core (internal).
#ifndef CKPTIO_SRC_TEXT_H_
#define CKPTIO_SRC_TEXT_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "ckptio/export.h"

namespace ckptio {

// `s` with control characters, quotes, backslashes and non-ASCII bytes
// escaped (\n, \x00, ...) and cut at 200 bytes, safe to put in a message.
CKPTIO_EXPORT_PRIVATE std::string Printable(std::string_view s);

// "1.5 GiB", "512 B".
CKPTIO_EXPORT_PRIVATE std::string HumanBytes(uint64_t bytes);

}  // namespace ckptio

#endif  // CKPTIO_SRC_TEXT_H_
