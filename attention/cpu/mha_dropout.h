// Internal to the CPU MHA kernels: the dropout multipliers of one score tile (attention/dropout.h for the generator
// and the math). Kept apart from the tile loops so that the kernels touch dropout in one place each.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <utility>

#include "mha_simd.h"
#include "../dropout.h"

namespace seqpar::attn::cpu {

struct MhaDropout {
  bool on = false;                             // p > 0
  std::uint64_t seed = 0;                      // DropoutSpec::seed
  std::uint64_t threshold = 0;                 // dropout_threshold(p): keep iff the pair's word >= threshold
  double scale = 1.0;                          // 1 / (1 - p), in double
  std::int64_t head_offset = 0;                // global index of the call's query head 0
  std::span<const std::int64_t> q_pos, k_pos;  // global positions (empty: 0, 1, 2, ...)
  std::span<const std::int64_t> q_tokens;      // MhaForwardArgs::q_tokens (empty: tokens = positions)
};

// The token of query row i and the shift from a key's position to its token (MhaForwardArgs::q_tokens): a padding
// row (token -1, no visible key) keeps its position and shift 0.
inline std::pair<std::int64_t, std::int64_t> dropout_row_token(const MhaDropout& d, std::int64_t i) {
  const std::int64_t qp = d.q_pos.empty() ? i : d.q_pos[static_cast<std::size_t>(i)];
  const std::int64_t qt = d.q_tokens.empty() ? qp : d.q_tokens[static_cast<std::size_t>(i)];
  return qt < 0 ? std::pair{qp, std::int64_t{0}} : std::pair{qt, qt - qp};
}

// z [mr, kBlock] (row stride kBlock): z[r, c] = 1 / (1 - p) if the pair (b, head_offset + h, token of query i0 + r,
// token of key j0 + c) is kept, else 0; 0 for key indices >= sk. Four consecutive key tokens share one Philox call.
template <typename T, int kBlock>
void dropout_multipliers(const MhaDropout& d, std::int64_t b, std::int64_t h, std::int64_t i0, int mr, std::int64_t j0,
                         std::int64_t sk, T* z) {
  const T scale = static_cast<T>(d.scale);
  for (int r = 0; r < mr; ++r) {
    const auto [qp, shift] = dropout_row_token(d, i0 + r);
    std::int64_t cached = -1;  // key token / 4 of the words in `w`
    std::array<std::uint32_t, 4> w{};
    for (int c = 0; c < kBlock; ++c) {
      const std::int64_t j = j0 + c;
      if (j >= sk) {
        z[r * kBlock + c] = T(0);
        continue;
      }
      const std::int64_t kp = (d.k_pos.empty() ? j : d.k_pos[static_cast<std::size_t>(j)]) + shift;
      if ((kp >> 2) != cached) {
        w = dropout_words(d.seed, b, d.head_offset + h, qp, kp);
        cached = kp >> 2;
      }
      z[r * kBlock + c] = w[static_cast<std::size_t>(kp & 3)] >= d.threshold ? scale : T(0);
    }
  }
}

// x[r, c] *= z[r, c] over mr rows of kBlock (a multiple of the vector width).
template <typename T, int kBlock>
void multiply_tile(int mr, const T* z, T* x) {
  using S = Simd<T>;
  for (int e = 0; e < mr * kBlock; e += S::W) S::store(x + e, S::mul(S::load(x + e), S::load(z + e)));
}

}  // namespace seqpar::attn::cpu
