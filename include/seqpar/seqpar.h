// seqpar: sequence (context) parallel attention layers over MPI. The one header a program needs:
// #include <seqpar/seqpar.h> with <prefix>/include (installed) or this project's targets (in-tree) on the include path.
// It includes the layers (MHA / GQA ring, Ulysses and USP; DSA; GDN and its short conv; the decode layers), the
// sequence layouts, the single-device kernels they run and the runtime (tensors, communicators, the SP grid).
#pragma once

#include <seqpar/attention/dsa.h>
#include <seqpar/attention/gdn.h>
#include <seqpar/attention/mha.h>
#include <seqpar/attention/rope.h>
#include <seqpar/parallel/decode_cp.h>
#include <seqpar/parallel/dsa_cp.h>
#include <seqpar/parallel/dsa_decode_cp.h>
#include <seqpar/parallel/gdn_cp.h>
#include <seqpar/parallel/layout.h>
#include <seqpar/parallel/ring_attention.h>
#include <seqpar/parallel/usp.h>
#include <seqpar/runtime/comm_factory.h>
#include <seqpar/runtime/error.h>
#include <seqpar/runtime/sp_grid.h>
#include <seqpar/runtime/tensor.h>
