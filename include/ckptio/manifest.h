// The manifest (MANIFEST.json): a checkpoint's commit record, and LATEST.
//
// Both are JSON objects sealed with a self-checksum: the member "checksum"
// holds the XXH3-128 (hex) of the object's canonical serialisation without
// that member (keys sorted, no whitespace: nlohmann::json::dump(), or
// Python's json.dumps(obj, sort_keys=True, separators=(",", ":"),
// ensure_ascii=False)). docs/FORMAT.md describes every field.
//
// Parsing is strict: unknown or missing members, wrong types, values out of
// range, illegal object names, counts or sizes beyond the limits below and a
// bad checksum are all DataLoss errors naming the field. A format version
// newer than this build understands is FailedPrecondition.
#ifndef CKPTIO_MANIFEST_H_
#define CKPTIO_MANIFEST_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/hash.h"
#include "ckptio/layout.h"
#include "ckptio/status.h"

namespace ckptio {

inline constexpr int kManifestFormatVersion = 1;
inline constexpr int kLatestFormatVersion = 1;

// Bounds that keep a hostile manifest from making us allocate gigabytes.
inline constexpr size_t kMaxManifestBytes = 64u << 20;
inline constexpr size_t kMaxLatestBytes = 4096;
inline constexpr size_t kMaxObjects = 100000;
inline constexpr size_t kMaxMetadataEntries = 10000;
inline constexpr size_t kMaxMetadataKeyBytes = 256;
inline constexpr size_t kMaxMetadataValueBytes = 1u << 20;
inline constexpr uint64_t kMaxObjectBytes = uint64_t{1} << 48;  // 256 TiB
inline constexpr uint64_t kMinChunkBytes = 4096;
inline constexpr uint64_t kMaxChunkBytes = 64u << 20;
inline constexpr uint64_t kDefaultChunkBytes = 4u << 20;
inline constexpr int64_t kMaxStep = 999999999999;  // 12 decimal digits

// OK if `name` may name an object inside a checkpoint: 1-200 bytes of
// [A-Za-z0-9._-], not starting with '.', not "MANIFEST.json". Names are flat:
// no '/'.
CKPTIO_EXPORT Status ValidateObjectName(std::string_view name);

// OK if a user metadata entry fits the limits above and both strings are
// valid UTF-8 (JSON cannot hold anything else). InvalidArgument otherwise.
CKPTIO_EXPORT Status ValidateMetadata(std::string_view key, std::string_view value);

struct CKPTIO_EXPORT ObjectEntry {
  std::string name;
  uint64_t size = 0;
  uint64_t chunk_size = kDefaultChunkBytes;
  Hash128 hash;                 // XXH3-128 of the whole object
  std::vector<Hash128> chunks;  // XXH3-128 of each chunk_size piece, in order

  // The number of chunks an object of `size` bytes has.
  static uint64_t ChunkCount(uint64_t size, uint64_t chunk_size) {
    return (size + chunk_size - 1) / chunk_size;
  }
};

// One tensor stored inside an object (a safetensors file written by the
// torch adapter): where its bytes are, and what they mean.
struct CKPTIO_EXPORT TensorEntry {
  std::string name;    // e.g. "layer1.weight"; unique within its object
  std::string object;  // the object holding the bytes
  std::string dtype;   // safetensors dtype: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL
  std::vector<int64_t> shape;
  std::string device;   // where it lived when saved, e.g. "cuda:0", "cpu"
  uint64_t offset = 0;  // byte range [offset, offset + length) of the object
  uint64_t length = 0;  // = product(shape) * element size
};

// Bytes per element of a safetensors dtype name; 0 if unknown.
CKPTIO_EXPORT size_t DtypeSize(std::string_view dtype);

inline constexpr size_t kMaxTensors = 1000000;
inline constexpr size_t kMaxTensorRank = 32;

// The metadata entry naming the folder, inside the step, that holds a
// step's objects, when they are not in the step's folder itself: one
// component (ValidateObjectName). Written where the backend's locks are
// leases (StorageBackend::LocksAreLeases): one folder per writer, so a
// writer that lost its lease cannot overwrite another's committed objects.
inline constexpr char kObjectsFolderKey[] = "ckptio.objects_folder";

struct CKPTIO_EXPORT Manifest {
  int format_version = kManifestFormatVersion;
  int64_t step = 0;
  int64_t generation = 0;  // the writer's fencing generation
  int64_t world_size = 1;
  int64_t saving_rank = 0;
  int64_t created_unix_ms = 0;
  std::string writer;                           // "host:pid", for humans
  std::vector<ObjectEntry> objects;             // sorted by name, unique
  std::vector<TensorEntry> tensors;             // optional; each inside its object
  std::map<std::string, std::string> metadata;  // user metadata

  // nullptr if absent.
  const ObjectEntry* Find(std::string_view name) const;
  // The store key of object `name`: "step-.../<name>", or
  // "step-.../<folder>/<name>" when the metadata names an objects folder.
  std::string ObjectKeyOf(std::string_view name) const;
  uint64_t TotalBytes() const;
};

// Serialises and seals. The manifest must be valid (the writer builds it).
CKPTIO_EXPORT std::string SerializeManifest(const Manifest& manifest);
// Serialises and seals a manifest after checking it exactly as
// ParseManifest checks what it reads (DataLoss naming `where` otherwise).
CKPTIO_EXPORT Result<std::string> SerializeCheckedManifest(const Manifest& manifest,
                                                           std::string_view where);

// Parses and checks everything above. `where` names the file in errors.
CKPTIO_EXPORT Result<Manifest> ParseManifest(std::string_view bytes, std::string_view where);

// LATEST: which step is newest, and the hash of its MANIFEST.json bytes.
struct CKPTIO_EXPORT Latest {
  int64_t step = 0;
  int64_t generation = 0;
  Hash128 manifest_hash;
};

CKPTIO_EXPORT std::string SerializeLatest(const Latest& latest);
CKPTIO_EXPORT Result<Latest> ParseLatest(std::string_view bytes, std::string_view where);

// .writer: the generation the current writer claimed, and who it is.
struct CKPTIO_EXPORT WriterRecord {
  int64_t generation = 0;
  std::string host;
  int64_t pid = 0;
  int64_t started_unix_ms = 0;
};

CKPTIO_EXPORT std::string SerializeWriterRecord(const WriterRecord& record);
CKPTIO_EXPORT Result<WriterRecord> ParseWriterRecord(std::string_view bytes,
                                                     std::string_view where);

// A small sealed record of string fields (the coordination records in
// .coord/): {"format": format, "version": 1, ...fields, "checksum": ...}.
CKPTIO_EXPORT std::string SerializeRecord(std::string_view format,
                                          const std::map<std::string, std::string>& fields);
// DataLoss if damaged or of another format, or over `max_bytes` (64 KiB
// unless told: a record carrying a stripe receipt may be as large as a
// manifest, kMaxManifestBytes).
inline constexpr size_t kMaxRecordBytes = 64u << 10;
CKPTIO_EXPORT Result<std::map<std::string, std::string>> ParseRecord(
    std::string_view bytes, std::string_view format, std::string_view where,
    size_t max_bytes = kMaxRecordBytes);

}  // namespace ckptio

#endif  // CKPTIO_MANIFEST_H_
