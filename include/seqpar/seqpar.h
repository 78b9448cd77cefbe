// seqpar's public C++ API in one include: the runtime (tensors, memory ledger, communicators, the process grid),
// the single-device kernels of attention/ and the context-parallel layers of parallel/. Internal headers (argument
// check helpers, CPU kernel internals, the fp64 references, fault injection) are not included.
#pragma once

#include "runtime/comm.h"
#include "runtime/comm_factory.h"
#include "runtime/device.h"
#include "runtime/dtype.h"
#include "runtime/env.h"
#include "runtime/error.h"
#include "runtime/memory.h"
#include "runtime/mpi_comm.h"
#include "runtime/nccl_comm.h"
#include "runtime/sp_grid.h"
#include "runtime/tensor.h"
#include "runtime/version.h"

#include "attention/dropout.h"
#include "attention/dsa.h"
#include "attention/dsa_cache.h"
#include "attention/gdn.h"
#include "attention/gdn_decode.h"
#include "attention/kv_cache.h"
#include "attention/mha.h"
#include "attention/rope.h"

#include "parallel/cp_common.h"
#include "parallel/decode_cp.h"
#include "parallel/dsa_cp.h"
#include "parallel/dsa_decode_cp.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "parallel/ring_attention.h"
#include "parallel/ulysses.h"
#include "parallel/usp.h"
