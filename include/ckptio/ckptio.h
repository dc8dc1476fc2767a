// Everything of the torch-free ckptio API.
#ifndef CKPTIO_CKPTIO_H_
#define CKPTIO_CKPTIO_H_

#include "ckptio/backend.h"
#include "ckptio/backends.h"
#include "ckptio/hash.h"
#include "ckptio/manifest.h"
#include "ckptio/safetensors.h"
#include "ckptio/status.h"
#include "ckptio/store.h"

#endif  // CKPTIO_CKPTIO_H_
