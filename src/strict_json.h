// Strict JSON parsing shared by the manifest and safetensors readers
// (internal): one document, no NUL bytes, bounded nesting, no repeated
// member names (nlohmann would silently keep the last).
#ifndef CKPTIO_SRC_STRICT_JSON_H_
#define CKPTIO_SRC_STRICT_JSON_H_

#include <nlohmann/json.hpp>
#include <string_view>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

// Errors are kDataLoss, "<where>: <what is wrong>".
CKPTIO_EXPORT_PRIVATE Result<nlohmann::json> ParseStrictJson(std::string_view bytes, int max_depth,
                                                             std::string_view where);

}  // namespace ckptio

#endif  // CKPTIO_SRC_STRICT_JSON_H_
