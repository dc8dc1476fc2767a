// The safetensors header text ckptio writes (internal): one function for the
// writer (ckptio_torch) and the reader's check, so that a header ckptio
// wrote is recognised by comparing bytes.
#ifndef CKPTIO_SRC_SAFETENSORS_TEXT_H_
#define CKPTIO_SRC_SAFETENSORS_TEXT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"

namespace ckptio {

// {"__metadata__":{"format":"pt"},"<name>":{"data_offsets":[b,e],"dtype":
// "F32","shape":[...]},...} for `tensors` in file order, with b and e each
// entry's offset less `data_start` (0 when the offsets are relative to the
// data section already), padded with spaces so that the data section starts
// 8-aligned. InvalidArgument when a name is not valid UTF-8.
CKPTIO_EXPORT_PRIVATE Result<std::string> SafetensorsHeaderText(
    const std::vector<const TensorEntry*>& tensors, uint64_t data_start);

// Whether `head` (an object's first bytes, through its header) is exactly
// the header ckptio writes for the manifest's entries of `object`, and those
// entries index the data section as the format requires (in order, no
// holes or overlaps, to the object's end): the case of every object ckptio
// wrote, recognised by comparing bytes instead of parsing 10,000 entries.
// The manifest must have passed its own checks (names, dtypes, sizes within
// the object). False for anything else, which the parser then judges.
CKPTIO_EXPORT_PRIVATE bool IsCkptioSafetensorsHeader(const Manifest& manifest,
                                                     const std::string& object,
                                                     std::string_view head);

}  // namespace ckptio

#endif  // CKPTIO_SRC_SAFETENSORS_TEXT_H_
