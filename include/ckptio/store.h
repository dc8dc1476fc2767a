// Store: the checkpoint commit protocol, on any StorageBackend.
//
// Layout (docs/FORMAT.md has the details):
//   <store>/LATEST                          newest committed step + manifest hash
//   <store>/.lock                           writer lock (fcntl, via the backend)
//   <store>/.writer                         the current writer's generation
//   <store>/step-000000001200/<objects>     one checkpoint's objects
//   <store>/step-000000001200/MANIFEST.json commit record, written last
//
// The protocol, in order (each numbered step is durable before the next):
//   1. OpenWriter takes the exclusive lock on .lock, claims generation
//      G = 1 + the highest generation on record and writes .writer, then
//      deletes stale temp objects (no live writer can own them; one that
//      cannot be deleted is logged and left).
//   2. Begin(step) refuses a step that is already committed (committed is
//      immutable) and clears leftovers of a torn attempt at that step (only
//      its own objects folder's where locks are leases: FORMAT.md).
//   3. Each object streams to the backend while XXH3-128 is computed over
//      the whole object and over every chunk_size piece; Close() commits it
//      (temp file, fsync, close, rename, directory fsync).
//   4. Commit() looks up every object it will name (there, of the size
//      written: else DataLoss), checks that .writer still names G (else
//      this writer was fenced: Aborted), then creates step-N/MANIFEST.json
//      exclusively.
//      The step is now committed: listed and loadable.
//   5. If N is the highest committed step, LATEST is atomically replaced to
//      name N and the hash of its manifest (fence checked again first).
//   6. Retention (keep_last) deletes old steps: MANIFEST.json first, so a
//      crash leaves a torn step, never a committed one with missing objects.
// A crash anywhere leaves the previous committed checkpoint and LATEST
// intact; what remains of the attempt is temp objects or a torn step (no
// MANIFEST.json), which readers never see and fsck --repair removes.
//
// Readers never get unverified bytes: CheckpointReader checks every chunk a
// read touches against the manifest before it returns OK; whole chunks are
// read straight into the caller's buffer and zeroed there if they fail.
//
// One writer per store. The lock is an fcntl lock, which POSIX ties to the
// process: closing *any* descriptor of .lock in the process drops it. ckptio
// therefore opens .lock in exactly one place and tracks held locks in the
// process, so a second writer in the same process is refused too. Do not
// open <store>/.lock yourself.
#ifndef CKPTIO_STORE_H_
#define CKPTIO_STORE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptio/backend.h"
#include "ckptio/export.h"
#include "ckptio/layout.h"
#include "ckptio/manifest.h"
#include "ckptio/status.h"

namespace ckptio {

// Called with the number of bytes processed since the last call.
using ProgressFn = std::function<void(uint64_t bytes)>;

// Reads one committed checkpoint, verifying every byte it returns.
// Not thread-safe; use one reader per thread.
class CKPTIO_EXPORT CheckpointReader {
 public:
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  int64_t step() const { return manifest_.step; }
  const Manifest& manifest() const { return manifest_; }
  // Hash of the MANIFEST.json bytes, as LATEST records it.
  const Hash128& manifest_hash() const { return manifest_hash_; }

  // Copies bytes [offset, offset+size) of object `name` into buf after
  // verifying every chunk that range touches. DataLoss (naming store, step,
  // object, byte range, expected and computed hash) on a mismatch or a
  // short object, and then buf holds zeros, never unverified bytes.
  // NotFound for an unknown object and InvalidArgument for a range outside
  // it are answered before buf is touched.
  Status Read(std::string_view name, uint64_t offset, void* buf, size_t size);
  // Read's answer for `name` and range [offset, offset+size) before any
  // byte is read: NotFound, InvalidArgument, or OK. For callers that
  // allocate the buffer (a binding) and want the error first.
  Status CheckRange(std::string_view name, uint64_t offset, uint64_t size) const;

  // The whole object, every chunk verified (as strong as the whole-object
  // hash: the sealed manifest fixes the chunks; VerifyObject checks both).
  Result<std::string> ReadAll(std::string_view name);

  // The whole object in memory with every chunk verified (on up to
  // `threads` threads; 0: one per core, at most 4): a private copy-on-write
  // memory map where the backend can make one, else a buffer read through
  // ReadAt, chunk by chunk, each chunk hashed by the thread that read it
  // (on as many threads as the reader takes reads at once,
  // ObjectReader::ConcurrentReads, at most `threads` unless 0). The view is
  // the caller's and outlives the reader. Errors as Read (nothing is
  // returned on a mismatch).
  Result<std::shared_ptr<ObjectView>> View(std::string_view name, unsigned threads = 0);
  // View of every object, in the manifest's order, each tensor file's
  // safetensors header checked against the manifest (as VerifyObject
  // does): the objects opened up to 4 at once, and where the readers take
  // concurrent reads (an object store, where each read is a round trip)
  // viewed up to 4 at once too (fewer where each takes more than 4);
  // elsewhere one after another. The error going one by one would meet
  // first; objects after it are not read.
  Result<std::vector<std::shared_ptr<ObjectView>>> ViewAll();
  // The same for the objects `names`, in that order (NotFound for a name
  // the manifest lacks, where going one by one would meet it).
  Result<std::vector<std::shared_ptr<ObjectView>>> ViewAll(const std::vector<std::string>& names);

  // Reads and checks every chunk and the whole-object hash of `name`. On a
  // map (local files), chunks are hashed on up to 3 helper threads while the
  // calling thread hashes the whole object and reports progress; elsewhere
  // chunk by chunk on the calling thread, one chunk's buffer in memory.
  Status VerifyObject(std::string_view name, const ProgressFn& progress = {});
  // VerifyObject for every object; the first error.
  Status Verify(const ProgressFn& progress = {});

 private:
  friend class Store;
  CheckpointReader(std::shared_ptr<StorageBackend> backend, Manifest manifest,
                   Hash128 manifest_hash);
  Result<ObjectReader*> Open(const ObjectEntry& entry);  // kept in open_
  Result<std::unique_ptr<ObjectReader>> OpenUncached(const ObjectEntry& entry) const;
  Status ChunkMismatch(const ObjectEntry& e, uint64_t chunk, const Hash128& got) const;

  std::shared_ptr<StorageBackend> backend_;
  Manifest manifest_;
  Hash128 manifest_hash_;
  std::map<std::string, std::unique_ptr<ObjectReader>, std::less<>> open_;
  std::string scratch_;
};

class PendingCheckpoint;
class StripeWriter;
struct StripeReceipt;

// Streams one object of a pending checkpoint. Must not outlive it.
class CKPTIO_EXPORT ObjectStream {
 public:
  ~ObjectStream();  // abandons the object if Close() did not succeed
  ObjectStream(const ObjectStream&) = delete;
  ObjectStream& operator=(const ObjectStream&) = delete;

  // Hashes and writes. After an error the stream is dead.
  Status Write(const void* data, size_t size);
  // Durably commits the object and records it for the manifest.
  Status Close();

 private:
  friend class PendingCheckpoint;
  friend class StripeWriter;
  struct State;
  explicit ObjectStream(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

struct CKPTIO_EXPORT CommitInfo {
  int64_t step = 0;
  int64_t generation = 0;
  Hash128 manifest_hash;
  uint64_t bytes = 0;
  bool latest_updated = false;   // false when a higher step exists
  std::vector<int64_t> retired;  // steps deleted by keep_last
  Status retention;              // a retention failure (the save stands)
};

// A checkpoint being written. Not thread-safe.
class CKPTIO_EXPORT PendingCheckpoint {
 public:
  // Abandons an uncommitted checkpoint, deleting what it wrote unless its
  // manifest may be there (its commit failed). Best effort. Never throws.
  ~PendingCheckpoint();
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;

  int64_t step() const;

  // Starts object `name` (see ValidateObjectName). InvalidArgument for a
  // bad or repeated name.
  Result<std::unique_ptr<ObjectStream>> AddObject(std::string_view name);
  // AddObject + Write + Close.
  Status PutObject(std::string_view name, const void* data, size_t size);
  Status SetMetadata(std::string key, std::string value);
  // Records a tensor stored in one of this checkpoint's objects (checked at
  // Commit against the object and its safetensors header: InvalidArgument).
  void AddTensor(TensorEntry tensor);

  // Adds the objects and tensors another rank wrote into this step (its
  // receipt, see StripeWriter). Each object must be in the step with the
  // size the receipt records (DataLoss otherwise: its writer died or the
  // step was cleared) and its name free (InvalidArgument). Abandoning the
  // checkpoint deletes them too.
  Status AddStripe(const StripeReceipt& receipt);
  // Marks the step as striped: other ranks may have written into it parts
  // this checkpoint never learns of (a rank whose receipt was refused or
  // never came). Abandoning it then clears everything in the step's
  // directory (the writer holds the lock and the step has no manifest), as
  // Begin clears a torn attempt, not only the objects it knows.
  void ExpectStripes();

  // Commits (protocol steps 4-6). FailedPrecondition if an object stream is
  // still open or failed. After an error the checkpoint is abandoned.
  Result<CommitInfo> Commit();

 private:
  friend class StoreWriter;
  friend class ObjectStream;
  friend class StripeWriter;
  friend class Store;
  struct State;
  explicit PendingCheckpoint(std::unique_ptr<State> state);
  static Result<std::unique_ptr<ObjectStream>> AddObjectTo(State& st, std::string_view name);
  std::unique_ptr<State> state_;
};

// Striped saves: ranks other than the writer write some of a step's
// objects themselves and hand the writer a receipt; the writer adds every
// receipt (PendingCheckpoint::AddStripe) before it commits. A stripe object
// is durable (committed by the backend) before its receipt exists, so a
// committed step never names a stripe that is not on storage.
struct CKPTIO_EXPORT StripeReceipt {
  int64_t step = 0;
  int rank = 0;
  std::vector<ObjectEntry> objects;  // sorted by name
  std::vector<TensorEntry> tensors;
};
// Sealed JSON, checked like a manifest (tensors inside their objects...).
CKPTIO_EXPORT std::string SerializeStripeReceipt(const StripeReceipt& receipt);
CKPTIO_EXPORT Result<StripeReceipt> ParseStripeReceipt(std::string_view bytes,
                                                       std::string_view where);

// One rank's stripe of a pending step. Not thread-safe. Takes no lock: the
// writer must have begun the step (and cleared a torn attempt at it) before
// any stripe of it starts.
class CKPTIO_EXPORT StripeWriter {
 public:
  // Unless Finish() succeeded, deletes the objects it closed (while the step is its writer's).
  ~StripeWriter();
  StripeWriter(const StripeWriter&) = delete;
  StripeWriter& operator=(const StripeWriter&) = delete;

  int64_t step() const;
  // As PendingCheckpoint::AddObject / AddTensor.
  Result<std::unique_ptr<ObjectStream>> AddObject(std::string_view name);
  void AddTensor(TensorEntry tensor);
  // Every stream closed: the receipt for the writer. FailedPrecondition if a
  // stream is open, the first object error if one failed.
  Result<StripeReceipt> Finish();

 private:
  friend class Store;
  StripeWriter(std::unique_ptr<PendingCheckpoint::State> state, int rank);
  std::unique_ptr<PendingCheckpoint::State> state_;
  int rank_;
};

struct CKPTIO_EXPORT WriterOptions {
  // How long OpenWriter waits for another writer to release the lock. It
  // tries again after 1 ms, then twice as long each time up to 20 ms (a
  // file lock) or 1 s (where locks are leases: each try is requests to a
  // server), so a lock let go is taken within about that.
  std::chrono::milliseconds lock_wait{0};
  // Keep this many newest committed steps after each commit; 0 keeps all.
  int keep_last = 0;
  uint64_t chunk_size = kDefaultChunkBytes;
  // Recorded in each manifest.
  int64_t world_size = 1;
  int64_t saving_rank = 0;
};

enum class StepState {
  kCommitted,    // MANIFEST.json present and valid (data not checked)
  kTorn,         // no MANIFEST.json: an unfinished or abandoned save
  kCorrupt,      // MANIFEST.json present but unreadable, or data bad
  kUnsupported,  // written by a newer ckptio (format version): never repaired
};
CKPTIO_EXPORT std::string_view StepStateName(StepState s);

struct CKPTIO_EXPORT StepEntry {
  int64_t step = 0;
  StepState state = StepState::kTorn;
  uint64_t bytes = 0;           // per manifest; for torn steps, what is there
  int64_t created_unix_ms = 0;  // 0 when unknown
  std::string problem;          // why kCorrupt
};

struct CKPTIO_EXPORT FsckProblem {
  enum class Kind { kStaleTemp, kTornStep, kCorruptStep, kBadLatest };
  Kind kind;
  int64_t step = -1;  // -1 when not about a step
  std::string detail;
};
CKPTIO_EXPORT std::string_view FsckKindName(FsckProblem::Kind k);

struct CKPTIO_EXPORT FsckReport {
  std::vector<int64_t> good_steps;  // committed and verified, ascending
  std::optional<int64_t> latest;    // what LATEST names, when readable
  bool writer_active = false;       // another writer held the lock
  // With a writer active: the torn step it writes an object of, else the
  // newest if torn (most likely its save); not counted as a problem.
  std::optional<int64_t> in_progress;
  std::vector<FsckProblem> problems;
  std::vector<std::string> repairs;  // what Repair() did, in order
  bool clean() const { return problems.empty(); }
};

struct CKPTIO_EXPORT RepairOptions {
  // When no committed step verifies, Repair leaves the newest corrupt one
  // whose manifest parses, else the newest (and LATEST, if it names that
  // step): it holds the newest state there is (what is intact can still be
  // read verified), and a trainer's load keeps failing
  // on it rather than starting over from nothing. True deletes it with the
  // others (and LATEST).
  bool delete_all_corrupt = false;
};

// What StoreWriter::CollectGarbage did.
struct CKPTIO_EXPORT GcReport {
  std::vector<int64_t> deleted;        // ascending
  std::optional<int64_t> newest_good;  // newest step that verifies (kept); none: no step does
  std::vector<FsckProblem> corrupt;    // newer committed steps that failed verification
  // Where locks are leases: old steps left whole because another writer
  // committed them again while gc ran (ascending).
  std::vector<int64_t> left;
};

// The one writer of a store (holds the lock until destroyed).
class CKPTIO_EXPORT StoreWriter {
 public:
  ~StoreWriter();
  StoreWriter(const StoreWriter&) = delete;
  StoreWriter& operator=(const StoreWriter&) = delete;

  int64_t generation() const;
  // Temp objects and unfinished uploads (StorageBackend::
  // AbortUnfinishedWrites) of dead writers removed when the lock was taken.
  size_t stale_temps_removed() const;

  // Starts checkpoint `step` (0..kMaxStep). AlreadyExists if committed;
  // FailedPrecondition if another checkpoint of this writer is pending;
  // Aborted if another writer took over the store (the writer fence).
  Result<std::unique_ptr<PendingCheckpoint>> Begin(int64_t step);

  // Deletes all but the newest `keep_last` (>= 1) committed steps, never the
  // one LATEST names and never the newest step that verifies: committed steps
  // are verified newest first until one passes (usually just the newest; the
  // progress callback counts the bytes read), so when the newest are corrupt
  // an older good step survives. Corrupt steps are reported (those outside
  // what is kept are deleted like any old step; Repair removes the rest). A
  // read error other than DataLoss while verifying stops gc before it
  // deletes anything, and the fence is checked again before each deletion.
  // Where locks are leases, each step's manifest is read just before it is
  // deleted, and a step another writer saved again meanwhile is left (and
  // logged; docs/FORMAT.md says what window remains). An error part-way
  // says which steps were already deleted.
  Result<GcReport> CollectGarbage(int keep_last, const ProgressFn& progress = {});

  // Store::Check, then fixes what it found: points LATEST at the newest
  // verified step (or removes it when none does, unless it names the step
  // left as below), deletes corrupt steps
  // (manifest first), torn steps and temp objects (where locks are leases,
  // none of another writer of its generation or above, and no step such a
  // writer committed meanwhile). Never deletes a step that verifies. When
  // none does, one corrupt step is left for salvage (see RepairOptions)
  // and still reported. Returns the check after repair, with `repairs` filled;
  // an error part-way says what was already repaired.
  Result<FsckReport> Repair(const ProgressFn& progress = {}, const RepairOptions& options = {});

 private:
  friend class Store;
  struct State;
  explicit StoreWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The step a load takes, and the newer ones it skipped.
struct CKPTIO_EXPORT StepChoice {
  int64_t step = 0;
  // Newer steps that failed verification, with the reason (the first 50,
  // 300 bytes of reason each: a decision travels as one small record).
  std::vector<std::pair<int64_t, std::string>> skipped;
};
// What a load logs for a step it skipped: "step 7 failed verification and
// is skipped; loading step 6 instead (<why>)".
CKPTIO_EXPORT std::string SkippedStepWarning(int64_t skipped, int64_t loading,
                                             std::string_view why);

class CKPTIO_EXPORT Store {
 public:
  // Opens the store at `uri` with the backend registered for its scheme.
  // Nothing is created until a writer commits.
  static Result<std::unique_ptr<Store>> Open(std::string_view uri, const BackendRegistry& registry);
  explicit Store(std::shared_ptr<StorageBackend> backend);

  std::string uri() const { return backend_->Uri(); }
  StorageBackend& backend() { return *backend_; }

  // Every step directory, ascending. NotFound if the store does not exist.
  // Reads and checks every manifest (to tell committed from corrupt).
  Result<std::vector<StepEntry>> ListSteps();

  // The steps whose directory holds a MANIFEST.json, ascending: what a load
  // may try, newest first, through OpenStep (which checks). Reads no
  // manifest. NotFound if the store does not exist.
  Result<std::vector<int64_t>> ListStepsWithManifest();

  // nullopt when there is no LATEST yet; DataLoss when it is corrupt.
  Result<std::optional<Latest>> ReadLatest();

  // The step a writer that numbers its saves itself takes next: after the
  // newest step that has a manifest and the one LATEST names (LATEST can lag
  // a committed step, or be unreadable: saving at a taken step would fail
  // every time). 0 for a store that does not exist yet.
  Result<int64_t> NextStep();

  // Opens committed step `step`: reads and checks its manifest.
  Result<std::unique_ptr<CheckpointReader>> OpenStep(int64_t step);
  // Opens the step LATEST names and checks that its manifest is the one
  // LATEST recorded. NotFound when the store has no LATEST.
  Result<std::unique_ptr<CheckpointReader>> OpenLatest();

  // The one rule of every load: `step` if given (its error if it does not
  // verify), else the newest step with a manifest that verifies, skipping
  // damaged ones (DataLoss) only; any other error stops the choice. nullopt
  // when the store holds no checkpoint (a fresh start); DataLoss naming the
  // newest problem when checkpoints exist but none verifies.
  // `verify` is handed each candidate, opened (its manifest checked), and
  // says whether it is good; by default CheckpointReader::Verify, which
  // reads every byte and keeps none (one chunk in memory at a time, so a
  // process that only chooses, like the coordinator of a sharded load,
  // never holds the step). A loader passes a check that keeps what it read.
  using StepCheck = std::function<Status(std::unique_ptr<CheckpointReader>)>;
  Result<std::optional<StepChoice>> ChooseStep(std::optional<int64_t> step,
                                               const StepCheck& verify = {});

  // Takes the writer lock (waiting up to options.lock_wait): a second writer
  // gets FailedPrecondition naming the holder's last known host and pid.
  Result<std::unique_ptr<StoreWriter>> OpenWriter(const WriterOptions& options);

  // Starts rank `rank`'s stripe of step `step` (see StripeWriter).
  // AlreadyExists if the step is committed.
  Result<std::unique_ptr<StripeWriter>> BeginStripe(int64_t step, int rank,
                                                    uint64_t chunk_size = kDefaultChunkBytes);

  // Reads everything and reports problems without changing anything.
  // Verifies all data of every committed step when verify_data is set.
  Result<FsckReport> Check(const ProgressFn& progress = {}, bool verify_data = true);

 private:
  std::shared_ptr<StorageBackend> backend_;
};

}  // namespace ckptio

#endif  // CKPTIO_STORE_H_
