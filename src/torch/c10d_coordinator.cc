// Coordination through a c10d::Store (the trainer's TCPStore).
#include "backoff.h"
#include "ckptio/torch.h"
#include "torch/c10d_store.h"

namespace ckptio {

namespace {

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string Text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

class C10dCoordinator : public Coordinator {
 public:
  C10dCoordinator(c10::intrusive_ptr<c10d::Store> store, RankInfo rank)
      : store_(std::move(store)), rank_(std::move(rank)) {}

  WaitMode mode() const override { return WaitMode::kStore; }

  Status BeginSave(int64_t, std::string_view, std::chrono::milliseconds) override {
    return OkStatus();
  }

  // "ok", or "failed:" + EncodeStatus(outcome).
  Status EndSave(int64_t step, std::string_view attempt, const Status& outcome) override {
    std::string value = outcome.ok() ? "ok" : "failed:" + EncodeStatus(outcome);
    return Call("publishing step " + std::to_string(step), [&] {
      store_->set(SaveKey(step, attempt), Bytes(value));
      return OkStatus();
    });
  }

  // Waits poll with check() (Coordinator::WaitSaved's loop, and WaitFor's),
  // never with the store's wait(): LibTorch 1.13's TCPStore client holds its
  // one lock for a whole wait(), so the trainer's own calls on the same
  // client would stall for the length of a save; and a wait() that times
  // out leaves its answer on the socket, to be read as the answer to the
  // next call.
  Result<bool> PollSaved(int64_t step, std::string_view attempt) override {
    const std::string key = SaveKey(step, attempt);
    if (key == last_read_) {  // counted: it may be gone, and is never read again
      CKPTIO_RETURN_IF_ERROR(Outcome(step, last_value_));
      return true;
    }
    std::optional<std::string> value;
    Status s = Call("checking step " + std::to_string(step), [&] {
      if (store_->check({key})) value = Text(store_->get(key));
      return OkStatus();
    });
    if (!s.ok()) return Lost(s, "rank 0 to commit step " + std::to_string(step));
    if (!value) return false;
    CountReader(key, *value);
    CKPTIO_RETURN_IF_ERROR(Outcome(step, *value));
    return true;
  }

  Status Publish(const std::string& name, const std::string& payload) override {
    return Call("publishing " + name, [&] {
      store_->set(DecisionKey(name), Bytes(payload));
      return OkStatus();
    });
  }

  Result<std::string> WaitFor(const std::string& name, std::chrono::milliseconds timeout) override {
    const std::string what = "\"" + name + "\" to be published";
    Backoff backoff(DeadlineAfter(timeout));
    while (true) {
      bool present = false;
      std::string value;
      Status s = Call("waiting for " + name, [&] {
        present = store_->check({DecisionKey(name)});
        if (present) value = Text(store_->get(DecisionKey(name)));
        return OkStatus();
      });
      if (!s.ok()) return Lost(s, what);
      if (present) return value;
      if (!backoff.Wait())
        return backoff.Stopped(Status(Code::kDeadlineExceeded,
                                      "timed out after " + std::to_string(timeout.count()) +
                                          " ms waiting for " + what + " (wait mode c10d-store)"));
    }
  }

  Status Retract(const std::string& name) override {
    return Call("retracting " + name, [&] {
      store_->deleteKey(DecisionKey(name));  // false when absent
      return OkStatus();
    });
  }

  void Consumed(const std::string& name) override { CountReader(DecisionKey(name), {}); }

 private:
  // This rank read `key` (a save's outcome or a decision, which every rank
  // but 0 reads once), whose value was `value`: counted in the store, and
  // the last reader deletes it with its count, so that a long job leaves no
  // key per save or load. Best effort: a key left behind only takes space.
  // Once counted, this rank never reads the key again (another rank may
  // delete it meanwhile, and TCPStore's get() of a missing key blocks) nor
  // counts it twice (which would delete it under a rank still waiting).
  void CountReader(const std::string& key, std::string value) {
    if (key == last_read_) return;
    last_read_ = key;
    last_value_ = std::move(value);
    const int64_t readers = rank_.world_size - 1;
    (void)Call("counting the readers of " + key, [&] {
      if (readers <= 1 || store_->add(ReadCountKey(key), 1) >= readers) {
        store_->deleteKey(key);
        if (readers > 1) store_->deleteKey(ReadCountKey(key));
      }
      return OkStatus();
    });
  }

  // A failed call on the store: its server went away.
  static Status Lost(const Status& s, const std::string& what) {
    return Status(Code::kUnavailable,
                  "lost the c10d store while waiting for " + what +
                      " (did rank 0, or the agent serving the store, die?): " + s.message());
  }

  // The attempt names the job, the Checkpointer and the save: a store that
  // outlives a restart, or serves several Checkpointers, never mixes them.
  static std::string SaveKey(int64_t step, std::string_view attempt) {
    return "ckptio/save/" + std::to_string(step) + "/" + std::string(attempt);
  }
  static std::string DecisionKey(const std::string& name) { return "ckptio/decision/" + name; }
  static std::string ReadCountKey(const std::string& key) { return "ckptio/read/" + key; }

  // The outcome rank 0 stored: OK, or its error.
  static Status Outcome(int64_t step, const std::string& value) {
    if (value == "ok") return OkStatus();
    constexpr std::string_view kFailed = "failed:";
    std::optional<Status> sent;
    if (value.rfind(kFailed, 0) == 0)
      sent = DecodeStatus(std::string_view(value).substr(kFailed.size()));
    // A value of another form, or a failure without an error code, is damaged.
    if (!sent || sent->ok())
      sent =
          Status(Code::kInternal, "unreadable outcome \"" + value.substr(0, 200) + "\"").FromPeer();
    return sent->WithContext("rank 0 failed to save step " + std::to_string(step));
  }

  // UNAVAILABLE for an exception of the store (its first line: LibTorch
  // appends a stack trace).
  template <typename Fn>
  Status Call(const std::string& what, Fn&& fn) {
    try {
      return fn();
    } catch (const std::exception& e) {
      const std::string text = e.what();
      return Status(Code::kUnavailable,
                    "c10d store: " + what + ": " + text.substr(0, text.find('\n')));
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  RankInfo rank_;
  std::string last_read_;   // the key CountReader counted last
  std::string last_value_;  // and its value (a save outcome's)
};

}  // namespace

Result<std::unique_ptr<Coordinator>> NewC10dCoordinator(c10::intrusive_ptr<c10d::Store> store,
                                                        const RankInfo& rank) {
  if (!store) return Status(Code::kInvalidArgument, "no c10d store given");
  CKPTIO_RETURN_IF_ERROR(rank.Validate());
  return std::unique_ptr<Coordinator>(std::make_unique<C10dCoordinator>(std::move(store), rank));
}

WaitOn WaitOn::Manifest() { return WaitOn(WaitMode::kManifest, nullptr); }
WaitOn WaitOn::FileLock() { return WaitOn(WaitMode::kFileLock, nullptr); }
WaitOn WaitOn::C10dStore(c10::intrusive_ptr<c10d::Store> store) {
  return WaitOn(WaitMode::kStore, std::make_shared<const internal::C10dStoreHandle>(
                                      internal::C10dStoreHandle{std::move(store)}));
}

}  // namespace ckptio
