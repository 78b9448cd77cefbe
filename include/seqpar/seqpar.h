// seqpar's public C++ API in one include: the runtime (tensors, memory ledger, communicators, the process grid),
// the single-device kernels of attention/ and the context-parallel layers of parallel/. Internal headers (argument
// check helpers, CPU kernel internals, the fp64 references, fault injection) are not included. Installed, it is
// found with <prefix>/include alone on the include path; in-tree, through this project's targets.
#pragma once

#include <seqpar/runtime/comm.h>
#include <seqpar/runtime/comm_factory.h>
#include <seqpar/runtime/device.h>
#include <seqpar/runtime/dtype.h>
#include <seqpar/runtime/env.h>
#include <seqpar/runtime/error.h>
#include <seqpar/runtime/memory.h>
#include <seqpar/runtime/mpi_comm.h>
#include <seqpar/runtime/nccl_comm.h>
#include <seqpar/runtime/cp_grid.h>
#include <seqpar/runtime/cp_grid_set.h>
#include <seqpar/runtime/tensor.h>
#include <seqpar/runtime/version.h>

#include <seqpar/attention/dropout.h>
#include <seqpar/attention/dsa.h>
#include <seqpar/attention/dsa_cache.h>
#include <seqpar/attention/gdn.h>
#include <seqpar/attention/gdn_decode.h>
#include <seqpar/attention/kv_cache.h>
#include <seqpar/attention/mha.h>
#include <seqpar/attention/rope.h>

#include <seqpar/parallel/cp_common.h>
#include <seqpar/parallel/decode_cp.h>
#include <seqpar/parallel/dsa_cp.h>
#include <seqpar/parallel/dsa_decode_cp.h>
#include <seqpar/parallel/dynamic_cp.h>
#include <seqpar/parallel/gdn_cp.h>
#include <seqpar/parallel/layout.h>
#include <seqpar/parallel/ring_attention.h>
#include <seqpar/parallel/ulysses.h>
#include <seqpar/parallel/usp.h>
