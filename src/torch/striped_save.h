// The records of a striped save (internal to ckptio_torch): their names, and
// a rank's failure as it travels in place of a receipt or a go-ahead.
// Checkpointer::Impl::SaveStripe (striped_save.cc) writes and reads them;
// Checkpointer::Impl::Abandon publishes a failure under them too.
#ifndef CKPTIO_SRC_TORCH_STRIPED_SAVE_H_
#define CKPTIO_SRC_TORCH_STRIPED_SAVE_H_

#include <optional>
#include <string>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio::internal {

// The decisions of a striped save: rank 0's go-ahead, and rank r's receipt.
std::string StripeGoName(const std::string& attempt);
std::string StripeReceiptName(const std::string& attempt, int r);

// A rank's failure, as it travels in place of a receipt or a go-ahead.
CKPTIO_EXPORT_PRIVATE std::string ErrorPayload(const Status& s);
// The failure `payload` holds (a Status from ErrorPayload), or nullopt.
CKPTIO_EXPORT_PRIVATE std::optional<Status> PayloadError(const std::string& payload);

}  // namespace ckptio::internal

#endif  // CKPTIO_SRC_TORCH_STRIPED_SAVE_H_
