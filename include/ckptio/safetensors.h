// The safetensors layout, read strictly (docs/FORMAT.md): an 8-byte
// little-endian header length N, N bytes of JSON header (a "__metadata__"
// map of strings and, for each tensor, its dtype, shape and data_offsets
// relative to the data section), then the data section, which the tensors
// must index exactly: in order, no overlaps, no holes, no trailing bytes.
#ifndef CKPTIO_SAFETENSORS_H_
#define CKPTIO_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"

namespace ckptio {

inline constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;  // the format's own limit

struct CKPTIO_EXPORT SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + N
  // Sorted by offset; offsets are from the start of the file. `object` is
  // the `where` given to the parser, `device` is empty.
  std::vector<TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
};

// 8 + N for a file of `file_size` bytes whose first 8 bytes are `first8`:
// how much to read before parsing. DataLoss if N is over the limit or past
// the end of the file.
CKPTIO_EXPORT Result<uint64_t> SafetensorsHeaderSize(std::string_view first8, uint64_t file_size,
                                                     std::string_view where);

// Parses the header at the start of `file` (at least SafetensorsHeaderSize
// bytes of a file of `file_size` bytes) and checks it against the layout
// above. Errors are DataLoss naming `where` and what is wrong. Accepts every
// dtype of the format (BOOL U8 I8 F8_E5M2 F8_E4M3 I16 U16 F16 BF16 I32 U32
// F32 F64 I64 U64).
CKPTIO_EXPORT Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view file,
                                                               uint64_t file_size,
                                                               std::string_view where);

class CheckpointReader;
// Reads (verified) and parses the header of `object`, and checks that the
// manifest's tensor entries for it name exactly the header's tensors with
// the same dtype, shape and byte range. DataLoss on any disagreement.
CKPTIO_EXPORT Status CheckSafetensorsObject(CheckpointReader& reader, const std::string& object);
// The same check on the object's bytes, already verified (CheckpointReader::View).
CKPTIO_EXPORT Status CheckSafetensorsObject(const Manifest& manifest, const std::string& object,
                                            std::string_view bytes);

}  // namespace ckptio

#endif  // CKPTIO_SAFETENSORS_H_
