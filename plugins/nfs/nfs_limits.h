// Limits of the nfs:// backend that its tests depend on (internal).
#ifndef CKPTIO_PLUGINS_NFS_NFS_LIMITS_H_
#define CKPTIO_PLUGINS_NFS_NFS_LIMITS_H_

#include <cstddef>

namespace ckptio::nfs_limits {

// libnfs 4.0 corrupts NFSv4 WRITEs above this size (the server rejects
// them), so v4 writes go in pieces no larger.
inline constexpr size_t kV4MaxWrite = 3840;
// One such piece at a time would leave the link idle between round trips,
// so v4 writes go in batches of this many pieces in flight at once, each
// batch under one hold of the connection (NFSv3 WRITEs are up to 1 MiB and
// go one at a time).
inline constexpr size_t kV4WritesInFlight = 64;

}  // namespace ckptio::nfs_limits

#endif  // CKPTIO_PLUGINS_NFS_NFS_LIMITS_H_
