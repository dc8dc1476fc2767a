// What the files of manifest_test share: a valid manifest and LATEST file,
// the edits that make hostile ones (re-sealed with a correct self-checksum,
// Reseal below, which follows the format documented in manifest.h, so each
// case reaches the check it targets instead of stopping at the checksum),
// and matchers.
//
// The files: manifest_round_trip_test.cc (manifest, LATEST and writer-record
// round trips), manifest_hostile_test.cc (hostile manifests and LATEST
// files), manifest_names_test.cc (step folders, keys, object names,
// metadata, URIs, the backend registry, XXH3-128).
#ifndef CKPTIO_TESTS_MANIFEST_TEST_UTIL_H_
#define CKPTIO_TESTS_MANIFEST_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <string>
#include <string_view>

#include "ckptio/hash.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"

namespace ckptio {

// gtest printers, found by argument-dependent lookup. Internal linkage so
// they cannot clash with another test file.
[[maybe_unused]] static void PrintTo(const Hash128& h, std::ostream* os) { *os << h.Hex(); }
[[maybe_unused]] static void PrintTo(Code code, std::ostream* os) { *os << CodeName(code); }

namespace manifest_testing {

using json = nlohmann::json;

constexpr Code kDL = Code::kDataLoss;
constexpr std::string_view kWhere = "store-x/step-000000000001/MANIFEST.json";

// Fails unless `st` is an error with `code` whose message contains every
// piece (empty pieces are ignored).
::testing::AssertionResult IsError(const Status& st, Code code,
                                   std::initializer_list<std::string_view> pieces);

// Re-seals a manifest/LATEST JSON object: drops "checksum", hashes the
// canonical dump of the rest and stores the hex digest (manifest.h).
std::string Reseal(json obj);

// The valid file, re-serialised compactly (first byte '{', keys sorted, so
// "checksum" is the first member).
std::string Compact(const std::string& valid);

// `s` with `text` inserted right after the first occurrence of `anchor`.
std::string InsertAfter(const std::string& s, std::string_view anchor, std::string_view text);

// `valid` with one hex digit of its self-checksum changed.
std::string FlipChecksumDigit(const std::string& valid);

Hash128 RandomHash(std::mt19937_64& rng);
ObjectEntry MakeEntry(std::string name, uint64_t size, uint64_t chunk_size, std::mt19937_64& rng);

// Three objects: 3 chunks of 4 MiB (the last short), 5 chunks of 4 KiB, and
// an empty object with no chunks.
Manifest MakeManifest();

// A 16 x 8 F32 tensor at `offset` of MakeManifest()'s model.safetensors.
TensorEntry FcWeight(std::string device, uint64_t offset);

const std::string& ValidManifestBytes();
Latest MakeLatest();
const std::string& ValidLatestBytes();

void ExpectManifestsEqual(const Manifest& want, const Manifest& got);

}  // namespace manifest_testing
}  // namespace ckptio

#endif  // CKPTIO_TESTS_MANIFEST_TEST_UTIL_H_
