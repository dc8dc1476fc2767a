// Coordination through a c10d::Store (the trainer's TCPStore).
#include "ckptio/torch.h"

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

  // "ok", or "failed:<code>:<message>".
  Status EndSave(int64_t step, std::string_view attempt, const Status& outcome) override {
    std::string value = outcome.ok()
                            ? "ok"
                            : "failed:" + std::to_string(static_cast<int>(outcome.code())) + ":" +
                                  outcome.message();
    return Call("publishing step " + std::to_string(step), [&] {
      store_->set(SaveKey(step, attempt), Bytes(value));
      return OkStatus();
    });
  }

  Result<bool> PollSaved(int64_t step, std::string_view attempt) override {
    bool present = false;
    CKPTIO_RETURN_IF_ERROR(Call("checking step " + std::to_string(step), [&] {
      present = store_->check({SaveKey(step, attempt)});
      return OkStatus();
    }));
    if (!present) return false;
    CKPTIO_RETURN_IF_ERROR(Outcome(step, attempt));
    return true;
  }

  Status WaitSaved(int64_t step, std::string_view attempt,
                   std::chrono::milliseconds timeout) override {
    Status waited = Call("waiting for step " + std::to_string(step), [&] {
      store_->wait({SaveKey(step, attempt)}, timeout);
      return OkStatus();
    });
    if (!waited.ok())
      return WaitError(waited, timeout, "rank 0 to commit step " + std::to_string(step));
    return Outcome(step, attempt);
  }

  Status Publish(const std::string& name, const std::string& payload) override {
    return Call("publishing " + name, [&] {
      store_->set(DecisionKey(name), Bytes(payload));
      return OkStatus();
    });
  }

  Result<std::string> WaitFor(const std::string& name, std::chrono::milliseconds timeout) override {
    std::string value;
    Status s = Call("waiting for " + name, [&] {
      store_->wait({DecisionKey(name)}, timeout);
      value = Text(store_->get(DecisionKey(name)));
      return OkStatus();
    });
    if (!s.ok()) return WaitError(s, timeout, "\"" + name + "\" to be published");
    return value;
  }

  Status Retract(const std::string& name) override {
    return Call("retracting " + name, [&] {
      store_->deleteKey(DecisionKey(name));  // false when absent
      return OkStatus();
    });
  }

 private:
  // A timeout is DeadlineExceeded; anything else (the store's server went
  // away) is Unavailable and says so, instead of claiming a timeout.
  static Status WaitError(const Status& s, std::chrono::milliseconds timeout,
                          const std::string& what) {
    const std::string& m = s.message();
    if (m.find("imeout") != std::string::npos || m.find("timed out") != std::string::npos)
      return Status(Code::kDeadlineExceeded, "timed out after " + std::to_string(timeout.count()) +
                                                 " ms waiting for " + what +
                                                 " (wait mode c10d-store): " + m);
    return Status(Code::kUnavailable,
                  "lost the c10d store while waiting for " + what +
                      " (did rank 0, or the agent serving the store, die?): " + m);
  }

  // The attempt names the job, the Checkpointer and the save: a store that
  // outlives a restart, or serves several Checkpointers, never mixes them.
  static std::string SaveKey(int64_t step, std::string_view attempt) {
    return "ckptio/save/" + std::to_string(step) + "/" + std::string(attempt);
  }
  static std::string DecisionKey(const std::string& name) { return "ckptio/decision/" + name; }

  Status Outcome(int64_t step, std::string_view attempt) {
    std::string value;
    CKPTIO_RETURN_IF_ERROR(Call("reading step " + std::to_string(step), [&] {
      value = Text(store_->get(SaveKey(step, attempt)));
      return OkStatus();
    }));
    if (value == "ok") return OkStatus();
    // failed:<code>:<message>
    size_t a = value.find(':'), b = value.find(':', a + 1);
    int code = static_cast<int>(Code::kInternal);
    if (value.rfind("failed:", 0) == 0 && b != std::string::npos) {
      try {
        code = std::stoi(value.substr(a + 1, b - a - 1));
      } catch (const std::exception&) {
      }
    }
    if (code <= 0 || code > static_cast<int>(Code::kInternal))
      code = static_cast<int>(Code::kInternal);
    return Status(static_cast<Code>(code),
                  "rank 0 failed to save step " + std::to_string(step) + ": " +
                      (b == std::string::npos ? value : value.substr(b + 1)));
  }

  template <typename Fn>
  Status Call(const std::string& what, Fn&& fn) {
    try {
      return fn();
    } catch (const std::exception& e) {
      return Status(Code::kUnavailable, "c10d store: " + what + ": " + e.what());
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  RankInfo rank_;
};

}  // namespace

Result<std::unique_ptr<Coordinator>> NewC10dCoordinator(c10::intrusive_ptr<c10d::Store> store,
                                                        const RankInfo& rank) {
  if (!store) return Status(Code::kInvalidArgument, "no c10d store given");
  CKPTIO_RETURN_IF_ERROR(rank.Validate());
  return std::unique_ptr<Coordinator>(std::make_unique<C10dCoordinator>(std::move(store), rank));
}

}  // namespace ckptio
