// cuDNN's support, without a device, of every SDPA graph (forward and backward) that the lowering emits for ring
// steps and all-gather calls of the contiguous, zigzag and stripe layouts (and packed documents) at the shapes of the
// tests, and every decode step's call of MhaDecodeCp on a token-sharded cache (s_q = 1 or a few new tokens against
// a rank's shard, causal on global positions): the frontend's validate() for sm_90 must accept each bf16 / fp16 key. This checks the frontend's support
// rules for the linked cuDNN, not that an engine runs (that needs the GPU check).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "attention/lowering.h"
#if defined(SEQPAR_WITH_CUDNN_FRONTEND)
#include <nlohmann/json.hpp>

#include "attention/cuda/cudnn_sdpa_graphs.h"
#endif

namespace seqpar {
namespace {

using attn::MaskSpec;

// Ring shard positions of rank r of P over S slots (S divisible by 2P): contiguous, zigzag (chunks r, 2P-1-r) or
// stripe (t mod P == r).
std::vector<std::int64_t> shard(const std::string& kind, std::int64_t S, int P, int r) {
  std::vector<std::int64_t> pos;
  const std::int64_t L = S / P, c = S / (2 * P);
  for (std::int64_t t = 0; t < S; ++t) {
    bool mine = false;
    if (kind == "contiguous") mine = t / L == r;
    if (kind == "zigzag") mine = t / c == r || t / c == 2 * P - 1 - r;
    if (kind == "stripe") mine = t % P == r;
    if (mine) pos.push_back(t);
  }
  return pos;
}

struct Case {
  std::vector<std::int64_t> q, k, lo, hi;  // lo / hi: document bounds per query (empty: one document)
  bool decode = false;                     // a decode step: causal only, one batch row per call (attn::mha_decode)
};

// The decode steps' calls: n new queries at [L, L + n) against the tokens of [0, L + n) that rank r of P holds
// (contiguous blocks of the capacity, or interleaved by I), the new ones it owns included.
void add_decode_cases(std::vector<Case>& v) {
  const std::int64_t L = 300, capacity = 384;
  for (int P : {1, 2, 4}) {
    for (std::int64_t interleave : {0, 1, 16}) {  // 0: contiguous
      for (std::int64_t n : {1, 4}) {
        for (int r = 0; r < P; ++r) {
          Case c;
          c.decode = true;
          for (std::int64_t t = L; t < L + n; ++t) c.q.push_back(t);
          const std::int64_t block = (capacity + P - 1) / P;
          for (std::int64_t t = 0; t < L + n; ++t) {
            const int owner = interleave == 0 ? static_cast<int>(t / block) : static_cast<int>((t / interleave) % P);
            if (owner == r) c.k.push_back(t);
          }
          if (!c.k.empty()) v.push_back(c);
        }
      }
    }
  }
}

[[maybe_unused]] std::vector<Case> cases() {  // read only with the cuDNN frontend
  std::vector<Case> v;
  const std::vector<std::int64_t> cu = {0, 100, 103, 103, 160, 161, 384};  // packed: 6 documents, one empty
  for (const std::string kind : {"contiguous", "zigzag", "stripe"}) {
    for (int P : {1, 2, 4}) {
      for (bool packed : {false, true}) {
        const std::int64_t S = 384;
        std::vector<std::int64_t> all(S);
        for (std::int64_t t = 0; t < S; ++t) all[t] = t;
        for (int r = 0; r < P; ++r) {
          Case base;
          base.q = shard(kind, S, P, r);
          if (packed) {
            for (std::int64_t t : base.q) {
              std::size_t d = 0;
              while (cu[d + 1] <= t) ++d;
              base.lo.push_back(cu[d]);
              base.hi.push_back(cu[d + 1]);
            }
          }
          for (int src = 0; src < P; ++src) {
            Case c = base;
            c.k = shard(kind, S, P, src);
            v.push_back(c);
          }
          Case ag = base;
          ag.k = all;
          v.push_back(ag);
        }
      }
    }
  }
  add_decode_cases(v);
  return v;
}

TEST(CudnnSdpaSupport, EveryLoweredGraphValidatesForSm90) {
#if !defined(SEQPAR_WITH_CUDNN_FRONTEND)
  GTEST_SKIP() << "built without the cuDNN frontend (needs SEQPAR_WITH_CUDA=ON, cuDNN, and the frontend's headers from "
                  "scripts/install_gpu_deps.sh)";
#else
  std::cout << "cuDNN " << attn::cudnn::cudnn_version() << "\n";
  std::vector<attn::cudnn::SdpaGraphKey> keys;
  int decode_keys = 0;  // forward keys of the decode cases (before removing duplicates)
  for (const Case& c : cases()) {
    for (int m = 0; m < 3; ++m) {
      if (c.decode && m != 1) continue;  // decode: causal, no window
      const MaskSpec mask(m > 0, m == 2 ? 64 : 0, c.lo, c.hi);
      const auto calls = attn::lowered_calls(attn::lower_attention_block(c.q, c.k, mask));
      for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
        const std::int64_t batch = c.decode || !c.lo.empty() ? 1 : 2;
        for (const auto& k : attn::cudnn::sdpa_graph_keys(calls, batch, 8, 2, 128, dt)) {
          if (c.decode && k.backward) continue;  // decode runs forward only
          if (c.decode) ++decode_keys;
          bool seen = false;
          for (const auto& e : keys) seen = seen || e == k;
          if (!seen) keys.push_back(k);
        }
      }
    }
  }
  // Keys the dispatch sends to the fallback (sdpa_fallback_reason) are counted, not required; every other key must
  // validate.
  int accepted = 0, fallback = 0, fallback_refused = 0;
  for (const auto& k : keys) {
    const std::string status = attn::cudnn::validate_sdpa_graph(k, 90);
    const std::string reason = attn::cudnn::sdpa_fallback_reason(k);
    if (!reason.empty()) {
      ++fallback;
      fallback_refused += status.empty() ? 0 : 1;
    } else if (status.empty()) {
      ++accepted;
    } else {
      ADD_FAILURE() << attn::cudnn::sdpa_key_str(k) << ": " << status;
    }
  }
  std::cout << "cuDNN SDPA support (validate, sm_90): " << keys.size() << " graph keys, " << accepted << " accepted, "
            << fallback << " sent to the fallback (" << fallback_refused << " of them refused by "
            << "validate); " << decode_keys << " of the decode steps' forward keys among them (with repeats); "
            << attn::cudnn::sdpa_graph_cache_size() << " graphs cached\n";
  EXPECT_GT(keys.size(), 0u);
  EXPECT_GT(decode_keys, 0);
#endif
}

// The backend's check_support() for every key above on each device whose properties a GPU run of
// scripts/gpu_check.sh captured (tests/data/device_properties/*.json, field cudnn_device_properties): an engine must
// claim every key that the dispatch sends to cuDNN. Skips, saying why, where no properties were captured yet or
// cuDNN cannot load a driver library (libcuda.so.1; ctest puts the toolkit's stub library on the path). The
// properties in tests/data are hand-made until a GPU run captures real ones.
TEST(CudnnSdpaSupport, EveryLoweredGraphHasAnEngineOnCapturedDevices) {
#if !defined(SEQPAR_WITH_CUDNN_FRONTEND)
  GTEST_SKIP() << "built without the cuDNN frontend";
#else
  std::vector<std::pair<std::string, std::string>> devices;  // (file, cuDNN's serialized properties)
  const std::filesystem::path dir = std::filesystem::path(SEQPAR_TEST_DATA_DIR) / "device_properties";
  if (std::filesystem::is_directory(dir)) {
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().extension() != ".json") continue;
      const nlohmann::json j = nlohmann::json::parse(std::ifstream(e.path()));
      if (j.contains("cudnn_device_properties")) devices.emplace_back(e.path().filename(), j["cudnn_device_properties"]);
    }
  }
  if (devices.empty()) {
    GTEST_SKIP() << "no device properties captured in " << dir << " (a GPU run of scripts/gpu_check.sh saves them)";
  }
  for (const auto& [file, props] : devices) {
    const int sm = nlohmann::json::parse(props).value("deviceVer", 900) / 10;
    int checked = 0;
    for (const Case& c : cases()) {
      if (checked > 200 && !c.decode) continue;  // a few hundred training keys per device are enough; every decode key
      const MaskSpec mask(true, 0, c.lo, c.hi);
      const auto calls = attn::lowered_calls(attn::lower_attention_block(c.q, c.k, mask));
      const std::int64_t batch = c.decode || !c.lo.empty() ? 1 : 2;
      for (const auto& k : attn::cudnn::sdpa_graph_keys(calls, batch, 8, 2, 128, DType::kBFloat16)) {
        if (!attn::cudnn::sdpa_fallback_reason(k).empty() || (c.decode && k.backward)) continue;
        const std::string status = attn::cudnn::check_sdpa_support(k, props, sm);
        if (status.find("libcuda") != std::string::npos) GTEST_SKIP() << file << ": " << status;
        EXPECT_EQ(status, "") << file << ": " << attn::cudnn::sdpa_key_str(k);
        ++checked;
      }
    }
    // and a refusal is reported: no Hopper engine has an fp32 backward
    attn::cudnn::SdpaGraphKey fp32_bwd;
    fp32_bwd.backward = true;
    fp32_bwd.dtype = DType::kFloat32;
    fp32_bwd.batch = 1;
    fp32_bwd.hq = fp32_bwd.hkv = 2;
    fp32_bwd.sq = fp32_bwd.sk = 128;
    fp32_bwd.head_dim = 128;
    EXPECT_NE(attn::cudnn::check_sdpa_support(fp32_bwd, props, sm), "") << file << ": fp32 backward";
    std::cout << file << ": " << checked << " keys checked with check_support()\n";
  }
#endif
}

}  // namespace
}  // namespace seqpar
