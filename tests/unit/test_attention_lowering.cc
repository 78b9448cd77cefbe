// The lowering of attention blocks into cuDNN-style masked rectangles (attention/lowering.h), checked exhaustively
// against seqpar's position mask: every layout kind x ring sizes 1-8 x Ulysses 1, 2 x every ring step, the
// all-gather call, the Ulysses call and the windowed key subsets x windows x unpacked lengths and document mixes.
// For each block, the union of the rectangles under the CPU model of cuDNN's mask (sdpa_mask_visible) must be the
// block's visible pairs exactly, with no pair twice, every rectangle row seeing a key, and cuDNN's constraints held
// (bottom-right and left bounds with sq <= sk, left bound >= 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "attention/lowering.h"
#include "parallel/layout.h"
#include "runtime/error.h"

namespace seqpar {
namespace {

using attn::DiagonalAlignment;
using attn::LoweredRect;
using attn::MaskSpec;

// seqpar's rule (docs/design.md): same document (the query's key-slot bounds), causal on slots, window on slots.
bool reference_visible(std::int64_t q, std::int64_t k, const MaskSpec& m, std::size_t i) {
  if (!m.doc_lo.empty() && (k < m.doc_lo[i] || k >= m.doc_hi[i])) return false;
  if (m.causal && k > q) return false;
  if (m.window > 0 && q - k >= m.window) return false;
  return true;
}

struct Stats {
  std::int64_t blocks = 0, pairs = 0, rects = 0, max_calls_unpacked = 0, max_calls_unpacked_window = 0,
               max_calls_packed = 0, shifted = 0, bottom_right = 0, suffix_band = 0, max_rects_ring_step = 0;
};

// Checks one block; returns an empty string or the first failure.
// ring_step: an unpacked ring step of the contiguous, zigzag or stripe layout (at most 3 rectangles without a window).
std::string check_block(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos, const MaskSpec& m,
                        bool unpacked, bool ring_step, Stats& st) {
  const std::vector<LoweredRect> rects = attn::lower_attention_block(q_pos, k_pos, m);
  const auto nq = static_cast<std::int64_t>(q_pos.size()), nk = static_cast<std::int64_t>(k_pos.size());
  std::vector<int> cover(static_cast<std::size_t>(nq * nk), 0);
  std::ostringstream err;
  for (const LoweredRect& r : rects) {
    if (r.q_begin < 0 || r.q_end > nq || r.k_begin < 0 || r.k_end > nk || r.sq() < 1 || r.sk() < 1) {
      err << "rectangle q [" << r.q_begin << ", " << r.q_end << ") k [" << r.k_begin << ", " << r.k_end
          << ") outside the block or empty";
      return err.str();
    }
    const bool br = r.mask.align == DiagonalAlignment::kBottomRight;
    if ((br || r.mask.left_bound > 0) && r.sq() > r.sk()) {
      err << "rectangle " << attn::sdpa_mask_str(r.mask) << " has sq " << r.sq() << " > sk " << r.sk();
      return err.str();
    }
    if (r.mask.left_bound < 0) return "negative left bound";
    if (br && r.sk() - r.sq() != 0) ++st.bottom_right;
    if (!r.mask.causal && r.mask.left_bound > 0) ++st.suffix_band;
    for (std::int64_t i = 0; i < r.sq(); ++i) {
      bool any = false;
      for (std::int64_t j = 0; j < r.sk(); ++j) {
        if (!attn::sdpa_mask_visible(r.mask, r.sq(), r.sk(), i, j)) continue;
        any = true;
        ++cover[static_cast<std::size_t>((r.q_begin + i) * nk + r.k_begin + j)];
      }
      if (!any) {
        err << "row " << i << " of rectangle q [" << r.q_begin << ", " << r.q_end << ") k [" << r.k_begin << ", "
            << r.k_end << ") " << attn::sdpa_mask_str(r.mask) << " sees no key";
        return err.str();
      }
    }
  }
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t j = 0; j < nk; ++j) {
      const int want = reference_visible(q_pos[i], k_pos[j], m, static_cast<std::size_t>(i)) ? 1 : 0;
      const int got = cover[static_cast<std::size_t>(i * nk + j)];
      st.pairs += want;
      if (got != want) {
        err << "pair (q row " << i << " slot " << q_pos[i] << ", k row " << j << " slot " << k_pos[j] << ") covered "
            << got << " times, expected " << want << " (" << rects.size() << " rectangles)";
        return err.str();
      }
    }
  }
  // One-row shift: a causal rectangle whose first key comes after the query row just before its first row.
  for (const LoweredRect& r : rects)
    if (r.mask.causal && r.q_begin > 0 && q_pos[r.q_begin - 1] < k_pos[r.k_begin]) ++st.shifted;
  const auto calls = static_cast<std::int64_t>(attn::lowered_calls(rects).size());
  if (unpacked) {
    std::int64_t& mx = m.window > 0 ? st.max_calls_unpacked_window : st.max_calls_unpacked;
    mx = std::max(mx, calls);
    if (m.window == 0 && calls > 3) {
      err << calls << " calls for an unpacked block without a window (at most 3 expected)";
      return err.str();
    }
  } else {
    st.max_calls_packed = std::max(st.max_calls_packed, calls);
  }
  if (ring_step && m.window == 0) {
    st.max_rects_ring_step = std::max(st.max_rects_ring_step, static_cast<std::int64_t>(rects.size()));
    if (rects.size() > 3) {
      err << rects.size() << " rectangles for a ring step without a window (at most 3 expected)";
      return err.str();
    }
  }
  ++st.blocks;
  st.rects += static_cast<std::int64_t>(rects.size());
  return {};
}

struct Mix {
  std::string name;
  bool packed;
  std::int64_t seq_len;                // unpacked
  std::vector<std::int64_t> doc_lens;  // packed
};

std::vector<Mix> mixes() {
  std::vector<Mix> v;
  for (std::int64_t s : {1, 5, 16, 37, 64, 100}) v.push_back({str_cat("S", s), false, s, {}});
  const std::vector<std::vector<std::int64_t>> docs = {
      {1}, {3, 0, 1, 7}, {0, 5, 0}, {13, 1, 1, 2, 30}, {64, 63, 1}, {1, 1, 1, 1, 1, 1, 1}, {40, 0, 0, 17, 9}};
  for (const auto& d : docs) {
    std::string name = "docs";
    for (std::int64_t l : d) name += str_cat("_", l);
    v.push_back({name, true, 0, d});
  }
  return v;
}

TEST(AttentionLowering, EveryStepOfEveryLayoutMatchesThePositionMask) {
  Stats st;
  std::int64_t cases = 0;
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe, LayoutKind::kBalanced}) {
    for (int ring = 1; ring <= 8; ++ring) {
      for (int uly : {1, 2}) {
        for (const Mix& mix : mixes()) {
          const SequenceLayout layout = mix.packed
                                            ? SequenceLayout::packed(kind, cu_seqlens_of(mix.doc_lens), ring, uly)
                                            : SequenceLayout(kind, mix.seq_len, ring, uly);
          const bool docs = layout.is_packed() || layout.has_padding();
          std::vector<std::int64_t> all(static_cast<std::size_t>(layout.padded_len()));
          for (std::int64_t t = 0; t < layout.padded_len(); ++t) all[t] = t;
          const DocBounds all_bounds = layout.doc_bounds_of_slots(all);
          for (bool causal : {false, true}) {
            for (std::int64_t window : {0, 1, 3, 8, 1 << 20}) {
              if (window > 0 && !causal) continue;
              auto run = [&](const char* what, int r, int src, std::span<const std::int64_t> q,
                             std::span<const std::int64_t> k, const DocBounds& b, bool ring_step = false) {
                MaskSpec m(causal, window);
                if (docs) {
                  m.doc_lo = b.lo;
                  m.doc_hi = b.hi;
                }
                ++cases;
                const std::string e =
                    check_block(q, k, m, !layout.is_packed(),
                                ring_step && !layout.is_packed() && kind != LayoutKind::kBalanced, st);
                ASSERT_TRUE(e.empty()) << layout_name(kind) << " ring " << ring << " ulysses " << uly << " " << mix.name
                                       << " causal " << causal << " window " << window << " " << what << " rank " << r
                                       << " src " << src << ": " << e;
              };
              for (int r = 0; r < ring; ++r) {
                const std::vector<std::int64_t> q = layout.ring_shard_positions(r);
                const DocBounds b = layout.doc_bounds_of_slots(q);
                for (int src = 0; src < ring; ++src) {
                  const std::vector<std::int64_t> k = layout.ring_shard_positions(src);
                  run("ring step", r, src, q, k, b, true);
                  if (window > 0) {  // the windowed exchange sends only the key rows some local query sees
                    std::vector<std::int64_t> seen;
                    for (std::int64_t kp : k) {
                      bool any = false;
                      for (std::size_t i = 0; i < q.size() && !any; ++i) {
                        MaskSpec m(causal, window);
                        if (docs) {
                          m.doc_lo = b.lo;
                          m.doc_hi = b.hi;
                        }
                        any = reference_visible(q[i], kp, m, i);
                      }
                      if (any) seen.push_back(kp);
                    }
                    run("windowed rows", r, src, q, seen, b);
                  }
                }
                // all-gather: the local queries against every slot in global order
                run("all-gather", r, -1, q, all, b);
                if (::testing::Test::HasFatalFailure()) return;
              }
              run("ulysses (whole row)", -1, -1, all, all, all_bounds);
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
  std::cout << "lowering: " << cases << " blocks checked (" << st.pairs << " visible pairs, " << st.rects
            << " rectangles; " << st.bottom_right << " bottom-right with sq < sk, " << st.shifted << " shifted causal, "
            << st.suffix_band << " left-bound-only); max calls per block: unpacked " << st.max_calls_unpacked
            << " (window: " << st.max_calls_unpacked_window << "), packed " << st.max_calls_packed
            << "; max rectangles per unpacked contiguous / zigzag / stripe ring step without a window "
            << st.max_rects_ring_step << "\n";
  EXPECT_GT(st.shifted, 0);       // the stripe case occurred
  EXPECT_GT(st.bottom_right, 0);  // the all-gather case occurred
  EXPECT_GT(st.max_rects_ring_step, 0);
}

// TransformerEngine's three zigzag cases on a ring of 4, S = 64 (chunks of 8 slots).
TEST(AttentionLowering, ZigzagStepsAreTransformerEnginesThreeCases) {
  const SequenceLayout layout(LayoutKind::kZigzag, 64, 4);
  const int r = 2;
  const std::vector<std::int64_t> q = layout.ring_shard_positions(r);
  const MaskSpec m(true);
  // step 0: one causal call over both halves
  auto own = attn::lower_attention_block(q, q, m);
  ASSERT_EQ(own.size(), 1u);
  EXPECT_TRUE(own[0].mask.causal);
  EXPECT_EQ(own[0].mask.align, DiagonalAlignment::kTopLeft);
  EXPECT_EQ(own[0].sq(), 16);
  EXPECT_EQ(own[0].sk(), 16);
  // src != rank: one rectangle without a mask, local queries [qb, qe) against received keys [kb, ke)
  const auto expect_one_unmasked = [&](int src, std::int64_t qb, std::int64_t qe, std::int64_t kb, std::int64_t ke) {
    const auto rects = attn::lower_attention_block(q, layout.ring_shard_positions(src), m);
    ASSERT_EQ(rects.size(), 1u) << "src " << src;
    EXPECT_EQ(rects[0].mask, attn::SdpaMask{}) << "src " << src;
    EXPECT_EQ(std::tie(rects[0].q_begin, rects[0].q_end, rects[0].k_begin, rects[0].k_end),
              std::make_tuple(qb, qe, kb, ke))
        << "src " << src;
  };
  // src < rank: every local query against the first half of the received keys
  expect_one_unmasked(1, 0, 16, 0, 8);
  // src > rank: the second half of the local queries against all received keys
  expect_one_unmasked(3, 8, 16, 0, 16);
}

// After an all-gather, a contiguous query chunk with a window is one bottom-right causal rectangle on the trimmed keys.
TEST(AttentionLowering, AllGatherWindowIsBottomRight) {
  std::vector<std::int64_t> q, all;
  for (std::int64_t t = 0; t < 64; ++t) all.push_back(t);
  for (std::int64_t t = 32; t < 48; ++t) q.push_back(t);
  auto rects = attn::lower_attention_block(q, all, MaskSpec(true, 8));
  ASSERT_EQ(rects.size(), 1u);
  EXPECT_EQ(rects[0].mask.align, DiagonalAlignment::kBottomRight);
  EXPECT_EQ(rects[0].mask.left_bound, 8);
  EXPECT_EQ(rects[0].k_begin, 32 - 7);
  EXPECT_EQ(rects[0].k_end, 48);
}

// Stripe, key block of a later rank: strictly lower in local indices; the first query row is dropped (one-row shift).
TEST(AttentionLowering, StripeLaterRankShiftsOneRow) {
  const SequenceLayout layout(LayoutKind::kStripe, 32, 4);
  const auto q = layout.ring_shard_positions(1), k = layout.ring_shard_positions(3);
  auto rects = attn::lower_attention_block(q, k, MaskSpec(true));
  ASSERT_EQ(rects.size(), 1u);
  EXPECT_TRUE(rects[0].mask.causal);
  EXPECT_EQ(rects[0].q_begin, 1);
  EXPECT_EQ(rects[0].q_end, 8);
  EXPECT_EQ(rects[0].k_begin, 0);
  EXPECT_EQ(rects[0].k_end, 7);
}

// The variants route a device call to the exact fallback (no SDPA graph), each named; a plain call has no reason.
TEST(AttentionLowering, VariantsRouteToTheFallbackByName) {
  attn::MhaForwardArgs a;
  EXPECT_EQ(attn::sdpa_variant_fallback_reason(a), "");
  std::vector<float> h(4, 0.5f);
  const TensorView heads(h.data(), DType::kFloat32, {4});
  const std::pair<const char*, void (*)(attn::MhaForwardArgs&, const TensorView&)> cases[] = {
      {"soft-capping", [](attn::MhaForwardArgs& x, const TensorView&) { x.mods.softcap = 30.0f; }},
      {"ALiBi", [](attn::MhaForwardArgs& x, const TensorView& t) { x.mods.alibi_slopes = t; }},
      {"sinks", [](attn::MhaForwardArgs& x, const TensorView& t) { x.mods.sinks = t; }},
      {"dropout", [](attn::MhaForwardArgs& x, const TensorView&) { x.dropout.p = 0.1; }}};
  attn::MhaForwardArgs all;
  for (const auto& [name, set] : cases) {
    attn::MhaForwardArgs one;
    set(one, heads);
    set(all, heads);
    const std::string why = attn::sdpa_variant_fallback_reason(one);
    EXPECT_EQ(why.rfind(name, 0), 0u) << why;
    EXPECT_NE(attn::sdpa_variant_fallback_reason(all).find(name), std::string::npos);
  }
}

TEST(AttentionLowering, BadInputNamesTheRule) {
  const std::vector<std::int64_t> q = {0, 2, 1}, k = {0, 1, 2};
  EXPECT_THROW(
      {
        try {
          attn::lower_attention_block(q, k, MaskSpec(true));
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("non-decreasing"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  EXPECT_THROW(attn::lower_attention_block(k, k, MaskSpec(false, 4)), Error);
}

}  // namespace
}  // namespace seqpar
