// Dropout on the attention probabilities with a counter-based generator (Philox-4x32-10, Salmon et al. 2011), so
// that the mask is a pure function of (seed, batch, global query head, global query position, global key position):
// identical on any grid, layout, ring step and thread count, and between the forward and the backward.
// Math: docs/design.md, "Attention dropout" (the counter and key of each pair, the keep test x >= ceil(p 2^32), and
// the forward and backward with dropout, FlashAttention-2).
//
// Range: 0 <= q_pos < 2^32, 0 <= k_pos < 2^34, 0 <= b, h < 2^32 (checked by the MHA kernels when p > 0).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "../runtime/host_device.h"

namespace seqpar::attn {

struct DropoutSpec {
  double p = 0.0;          // drop probability in [0, 1); 0: no dropout (bitwise the kernels without dropout)
  std::uint64_t seed = 0;  // the generator's key

  // Error unless p is a finite number in [0, 1); `what` names the caller in the message.
  void validate(const char* what) const;
};

// Philox-4x32-10 (Salmon et al. 2011, section 4.2): ten rounds of two 32 x 32 -> 64-bit multiplies with the key
// bumped by the Weyl constants between rounds, on ctr in place. The one body of the generator: the CPU kernels, the
// fp64 reference and the CUDA fallback's row bodies (attention/fallback_rows.h) all call it, so every device draws
// the same mask. Known-answer vectors: Random123's kat_vectors (tests/unit).
SEQPAR_HOST_DEVICE inline void philox4x32_10_inplace(std::uint32_t* ctr, std::uint32_t key0, std::uint32_t key1) {
  constexpr std::uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += kW0;
      key1 += kW1;
    }
    const std::uint64_t p0 = kM0 * ctr[0], p1 = kM1 * ctr[2];
    const std::uint32_t c1 = ctr[1], c3 = ctr[3];
    ctr[0] = static_cast<std::uint32_t>(p1 >> 32) ^ c1 ^ key0;
    ctr[1] = static_cast<std::uint32_t>(p1);
    ctr[2] = static_cast<std::uint32_t>(p0 >> 32) ^ c3 ^ key1;
    ctr[3] = static_cast<std::uint32_t>(p0);
  }
}

// The same on arrays (host code).
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> ctr, std::array<std::uint32_t, 2> key) {
  philox4x32_10_inplace(ctr.data(), key[0], key[1]);
  return ctr;
}

// The word of pair (b, h, q_pos, k_pos) (word k_pos mod 4 of the call of dropout_words below), host-device.
SEQPAR_HOST_DEVICE inline std::uint32_t dropout_word(std::uint64_t seed, std::int64_t b, std::int64_t h,
                                                     std::int64_t q_pos, std::int64_t k_pos) {
  std::uint32_t ctr[4] = {static_cast<std::uint32_t>(k_pos >> 2), static_cast<std::uint32_t>(q_pos),
                          static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(b)};
  philox4x32_10_inplace(ctr, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  return ctr[k_pos & 3];
}

// The four words of the Philox call that holds key positions 4 (k_pos / 4) .. 4 (k_pos / 4) + 3 of row
// (b, h, q_pos); word k_pos mod 4 is the pair's (docs/design.md, "Attention dropout").
inline std::array<std::uint32_t, 4> dropout_words(std::uint64_t seed, std::int64_t b, std::int64_t h,
                                                  std::int64_t q_pos, std::int64_t k_pos) {
  return philox4x32_10({static_cast<std::uint32_t>(k_pos >> 2), static_cast<std::uint32_t>(q_pos),
                        static_cast<std::uint32_t>(h), static_cast<std::uint32_t>(b)},
                       {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
}

// ceil(p 2^32): the pair is kept iff its word is >= this (p in [0, 1); p 2^32 is exact in double).
inline std::uint64_t dropout_threshold(double p) { return static_cast<std::uint64_t>(std::ceil(std::ldexp(p, 32))); }

// Whether the pair (b, global head h, q_pos, k_pos) is kept under drop probability p. One Philox call.
inline bool dropout_keep(std::uint64_t seed, std::int64_t b, std::int64_t h, std::int64_t q_pos, std::int64_t k_pos,
                         double p) {
  return dropout_words(seed, b, h, q_pos, k_pos)[static_cast<std::size_t>(k_pos & 3)] >= dropout_threshold(p);
}

}  // namespace seqpar::attn
