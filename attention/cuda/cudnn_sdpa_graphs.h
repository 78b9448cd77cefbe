// cuDNN SDPA graphs (forward with fp32 natural-log stats, deterministic backward) for the lowered calls of
// attention/lowering.h, with a plan cache keyed by everything that shapes a graph. Host code only: the one
// translation unit that includes the cuDNN frontend (it compiles slowly); built when CUDA is on and the frontend's
// headers are found (scripts/install_gpu_deps.sh), with the definition SEQPAR_WITH_CUDNN_FRONTEND.
//
// Layouts are seqpar's: q / o / do [B, S, H, D] and k / v [B, S, Hkv, D] contiguous (cuDNN dims [B, H, S, D] with
// strides [S H D, D, H D, 1]); stats [B, H, S, 1] fp32. A ragged key (ragged = true) is one THD call: B segments
// with per-segment offsets and lengths (padding mask on), s_q / s_kv the largest segment.
// Support without a device: validate_sdpa_graph builds the graph for a target SM (default 90) and runs the
// frontend's validate(), which checks the frontend's support rules for that SM and the linked cuDNN version; it
// does not ask the backend for an engine (that needs a device or its serialized properties) and runs nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../lowering.h"
#include "../../runtime/dtype.h"

namespace seqpar::attn::cudnn {

struct SdpaGraphKey {
  bool backward = false;
  DType dtype = DType::kBFloat16;  // q, k, v, o (and do, dq, dk, dv)
  std::int64_t batch = 0, hq = 0, hkv = 0, sq = 0, sk = 0, head_dim = 0;
  bool ragged = false;
  SdpaMask mask;
  float scale = 0.0f;  // <= 0: 1 / sqrt(head_dim)
  bool operator==(const SdpaGraphKey&) const = default;
};
// Every field, readable (the plan cache's key with the scale and the SM added).
std::string sdpa_key_str(const SdpaGraphKey& key);

// The forward and backward keys of the calls of a lowered block (lowered_calls) for batch B, heads (hq, hkv), head
// dim and dtype: a call of one segment is dense with that segment's sizes; a call of several is ragged over B x
// segments.
std::vector<SdpaGraphKey> sdpa_graph_keys(const std::vector<LoweredCall>& calls, std::int64_t batch, std::int64_t hq,
                                          std::int64_t hkv, std::int64_t head_dim, DType dtype);

// Why a key goes to the fallback path instead of cuDNN ("" when cuDNN is expected to take it): fp64 (no cuDNN
// engine), fp32 backward (forward-only engine), backward of a call whose segments are all one query against one key
// (validate(): "s_q = s_kv = 1 is not supported", seen with cuDNN 9.19 for sm_90; e.g. a length-1 document).
std::string sdpa_fallback_reason(const SdpaGraphKey& key);

// The cuDNN library version linked (e.g. 91900).
std::int64_t cudnn_version();
// "" when the frontend's validate() accepts the key's graph for `sm_version`, else its message. Graphs are built
// once per (key, sm_version) and cached (thread-safe).
std::string validate_sdpa_graph(const SdpaGraphKey& key, int sm_version = 90);
// Graphs in the cache.
std::int64_t sdpa_graph_cache_size();

// One dense rectangle of a lowered call run by a cuDNN SDPA graph on the current CUDA device. key: the rectangle's
// sizes (batch, heads, sq, sk, head dim), mask, dtype (bf16 / fp16), scale, direction; ragged must be false.
// Pointers are device pointers of the key's dtype unless stated. Inputs point at the rectangle's first row inside
// the caller's full tensors: q (and, backward, o and dout) with q_rows rows per batch entry, k / v with k_rows, the
// backward's stats (the final lse, fp32 [B, Hq, lse_rows]) at the rectangle's first query. Outputs are compact:
// forward o [B, sq, Hq, D] and stats [B, Hq, sq] fp32 (natural log); backward dq [B, sq, Hq, D], dk / dv
// [B, sk, Hkv, D] (overwritten: the rectangle's contributions only).
struct SdpaRectCall {
  SdpaGraphKey key;
  std::int64_t q_rows = 0, k_rows = 0, lse_rows = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;            // forward: output; backward: input (the final out), cast away
  void* stats = nullptr;        // forward: output; backward: input (the final lse)
  const void* dout = nullptr;   // backward
  void* dq = nullptr;           // backward
  void* dk = nullptr;
  void* dv = nullptr;
};
// The plan cache's key of a call: every field of the key, the scale and the strides.
std::string sdpa_call_key_str(const SdpaRectCall& c);
// Runs the call on `stream` (a cudaStream_t) with a plan built once per (call key, device) and cached; false, with
// the reason in *why, when cuDNN has no engine for it (validate, check_support or the plan build refused: the
// caller takes the fallback). Errors: a failed execution, CUDA or cuDNN errors.
bool run_sdpa(const SdpaRectCall& c, void* stream, std::string* why);

// cuDNN's own JSON serialization of CUDA device `device_id`'s properties (DeviceProperties, cuDNN >= 9.8), the test
// data a deviceless support check reads. Needs the device. Errors: cuDNN's message.
std::string serialized_device_properties(int device_id);

// "" when cuDNN's backend has an engine that claims support for the key's graph on the device whose properties
// `device_properties_json` holds (cuDNN's serialization: serialized_device_properties, saved by device_probe as
// cudnn_device_properties), else the reason. Without a device: the graph is built for the properties' SM, its
// operation graph without a handle, plans from heuristics mode A, then check_support(). Needs libcuda.so.1 to load
// (a driver, or the toolkit's stub library); builds no plan and runs nothing, so it checks that an engine claims
// the graph, not that it runs. Not cached.
std::string check_sdpa_support(const SdpaGraphKey& key, const std::string& device_properties_json, int sm_version = 90);

}  // namespace seqpar::attn::cudnn
