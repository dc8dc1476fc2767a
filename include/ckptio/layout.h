// Every name in a store, in one place: what the core, the backends, the
// tools and the tests call the objects of a store, and how a name is parsed
// back. Nothing outside this header spells a store name by hand.
//
//   <store>/LATEST                        newest committed step + manifest hash
//   <store>/.lock                         the writer lock (exclusive, for a job's life)
//   <store>/.writer                       the current writer's generation (fencing)
//   <store>/.save-lock                    held by rank 0 while it saves (WaitMode::kFileLock)
//   <store>/.coord/save                   the last save's record (waits by file lock)
//   <store>/.coord/decision-<name>        a load decision rank 0 publishes
//   <store>/step-000000001200/            one checkpoint (StepDirName)
//   <store>/step-000000001200/MANIFEST.json   its commit record, written last
//   <store>/step-000000001200/<object>    its objects; "<stem>.part-<rank>.safetensors"
//                                         for a rank's part of a striped save
//   <store>/step-000000001200/w<gen>-<hex>/<object>   ... in the writer's objects
//                                         folder where locks are leases
//   .../.ckptio-tmp.<base>.<host>.<pid>.<n>.<random>   an object being written
//
// The last form is the backend contract for in-flight data (backend.h): a
// backend that cannot write an object in place writes it under
// TempObjectName(<its base name>) in the same folder and renames it at
// commit; the core sweeps such names (IsSweepableTempKey) when no writer
// holds the lock. docs/FORMAT.md describes each file.
#ifndef CKPTIO_LAYOUT_H_
#define CKPTIO_LAYOUT_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "ckptio/export.h"

namespace ckptio {

// Top-level keys.
inline constexpr std::string_view kLatestKey = "LATEST";
inline constexpr std::string_view kLockKey = ".lock";
inline constexpr std::string_view kWriterKey = ".writer";
inline constexpr std::string_view kSaveLockKey = ".save-lock";
inline constexpr std::string_view kCoordDir = ".coord";
inline constexpr std::string_view kSaveRecordKey = ".coord/save";
// Every load decision's key starts with this (a List prefix).
inline constexpr std::string_view kDecisionPrefix = ".coord/decision-";

// The manifest's own file name inside a step directory.
inline constexpr std::string_view kManifestName = "MANIFEST.json";

// "step-000000001200" for 1200 (steps 0..kMaxStep, manifest.h).
CKPTIO_EXPORT std::string StepDirName(int64_t step);
// The step of a directory name of exactly that form; -1 otherwise.
CKPTIO_EXPORT int64_t ParseStepDirName(std::string_view name);
// "step-000000001200/MANIFEST.json".
CKPTIO_EXPORT std::string ManifestKey(int64_t step);
// "step-000000001200/<object>".
CKPTIO_EXPORT std::string ObjectKey(int64_t step, std::string_view object);
// ".coord/decision-<name>".
CKPTIO_EXPORT std::string DecisionKey(std::string_view name);

// Whether `key` is something ckptio writes at a store's top (LATEST, the
// lock and record files, .coord/..., step-*/...): how the tools tell a
// store from its parent folder.
CKPTIO_EXPORT bool IsStoreKey(std::string_view key);

// Striped saves: rank `rank`'s part of object "model.safetensors" is
// "model.part-<rank>.safetensors" (the ".safetensors" ending is kept, so
// every part stays a safetensors file; an object without it gets
// ".part-<rank>.safetensors" appended).
CKPTIO_EXPORT std::string StripePartName(std::string_view object, int rank);
// The manifest metadata key that records which object a part belongs to:
// kStripePartPrefix + "model.part-2.safetensors" -> "model.safetensors".
inline constexpr char kStripePartPrefix[] = "ckptio.part.";

// The last component of every in-flight (uncommitted) object starts with this.
inline constexpr std::string_view kTempMarker = ".ckptio-tmp.";
// The unique name an object `base` (a key's last component) is written
// under until its commit:
// ".ckptio-tmp.<base, cut at 100>.<host>.<pid>.<n>.<random>"; key-safe,
// unique in this process and, with its random part, across hosts.
CKPTIO_EXPORT std::string TempObjectName(std::string_view base);
// Whether a key's last component is a temp name.
CKPTIO_EXPORT bool IsTempObjectName(std::string_view base);
// A temp object where ckptio writes: the top level, a step folder, a
// writer's objects folder in a step, or .coord/. Anything deeper or
// elsewhere is not the core's to sweep.
CKPTIO_EXPORT bool IsSweepableTempKey(std::string_view key);

// Where a backend's locks are leases (StorageBackend::LocksAreLeases), each
// writer puts a step's objects in a folder of its own inside the step,
// "w<generation>-<16 hex digits>" (manifest.h, kObjectsFolderKey): the
// writer's generation (>= 0), then `id` (a hash of its lock record).
CKPTIO_EXPORT std::string ObjectsFolderName(int64_t generation, uint64_t id);
// The generation of such a folder name; -1 if `name` is not one.
CKPTIO_EXPORT int64_t ObjectsFolderGeneration(std::string_view name);

// For names unique to a process (lock owners, upload ids): the host name
// cut to 32 characters of [A-Za-z0-9_-], and 16 random hex digits.
CKPTIO_EXPORT std::string KeySafeHostName();
CKPTIO_EXPORT std::string RandomHex();

}  // namespace ckptio

#endif  // CKPTIO_LAYOUT_H_
