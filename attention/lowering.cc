// Lowering of one attention block into masked rectangles (see lowering.h for the rule and the construction).
#include "attention/lowering.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "runtime/error.h"

namespace seqpar::attn {
namespace {

// Rows [qa, qb) of one document against its keys [ka, kb): row i sees the key rows [lo(i), hi(i)), both
// non-decreasing in i (a staircase). Consecutive rows whose (lo, hi) steps are one pair of {0, 1} form one rectangle:
// (0, 0) no mask; (0, 1) causal with the diagonal at the rows' last keys; (1, 1) the same with a left bound (the
// window in rows); (1, 0) left bound only. A row of its own is an unmasked rectangle.
void lower_staircase(std::vector<LoweredRect>& out, std::span<const std::int64_t> q_pos,
                     std::span<const std::int64_t> k_pos, std::int64_t qa, std::int64_t qb, std::int64_t ka,
                     std::int64_t kb, const MaskSpec& mask) {
  const auto kbeg = k_pos.begin() + ka, kend = k_pos.begin() + kb;
  auto bounds = [&](std::int64_t i) {
    const std::int64_t q = q_pos[i];
    const std::int64_t hi = mask.causal ? std::upper_bound(kbeg, kend, q) - k_pos.begin() : kb;
    const std::int64_t lo = mask.window > 0 ? std::lower_bound(kbeg, kend, q - mask.window + 1) - k_pos.begin() : ka;
    return std::pair(lo, std::max(lo, hi));
  };
  std::int64_t i = qa;
  auto [lo, hi] = bounds(qa);
  while (i < qb) {
    if (lo == hi) {  // sees no key of this block
      if (++i < qb) std::tie(lo, hi) = bounds(i);
      continue;
    }
    const std::int64_t a = i, lo_a = lo, hi_a = hi;
    std::int64_t dlo = -1, dhi = -1;  // the segment's steps, fixed by its second row
    ++i;
    while (i < qb) {
      std::tie(lo, hi) = bounds(i);
      if (lo == hi) break;
      const std::int64_t s_lo = lo - (lo_a + (dlo < 0 ? 0 : dlo) * (i - 1 - a)),
                         s_hi = hi - (hi_a + (dhi < 0 ? 0 : dhi) * (i - 1 - a));
      if (dlo < 0) {
        if (s_lo < 0 || s_lo > 1 || s_hi < 0 || s_hi > 1) break;
        dlo = s_lo;
        dhi = s_hi;
      } else if (s_lo != dlo || s_hi != dhi) {
        break;
      }
      ++i;
    }
    const std::int64_t b = i, last = b - 1;
    const std::int64_t k0 = lo_a, k1 = hi_a + (dhi < 0 ? 0 : dhi) * (last - a);
    SdpaMask m;
    if (dhi == 1) {  // the rows' last keys step with the rows: causal, diagonal offset e = hi_a - lo_a - 1 >= 0
      m.causal = true;
      m.align = hi_a - lo_a - 1 == 0 ? DiagonalAlignment::kTopLeft : DiagonalAlignment::kBottomRight;
      if (dlo == 1) m.left_bound = hi_a - lo_a;  // the rows' first keys too: a band of hi - lo keys
    } else if (dlo == 1) {
      m.left_bound = 1;  // first keys step, last keys fixed: row t of the rectangle sees keys t onwards
    }
    out.push_back({a, b, k0, k1, m});
  }
}

void check_positions(std::span<const std::int64_t> pos, const char* name) {
  for (std::size_t i = 1; i < pos.size(); ++i)
    SEQPAR_CHECK(pos[i] >= pos[i - 1], "attention lowering: ", name, "[", i, "] = ", pos[i], " < ", name, "[", i - 1,
                 "] = ", pos[i - 1], "; positions must be non-decreasing");
}

}  // namespace

std::vector<LoweredRect> lower_attention_block(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                                               const MaskSpec& mask) {
  check_positions(q_pos, "q_pos");
  check_positions(k_pos, "k_pos");
  SEQPAR_CHECK(mask.window >= 0, "attention lowering: window ", mask.window, " must be >= 0 (0: none)");
  SEQPAR_CHECK(mask.window == 0 || mask.causal, "attention lowering: a sliding window (window=", mask.window,
               ") needs causal");
  const bool docs = !mask.doc_lo.empty() || !mask.doc_hi.empty();
  SEQPAR_CHECK(!docs || (mask.doc_lo.size() == q_pos.size() && mask.doc_hi.size() == q_pos.size()),
               "attention lowering: doc_lo (", mask.doc_lo.size(), ") and doc_hi (", mask.doc_hi.size(),
               ") must both be empty or have Sq = ", q_pos.size(), " entries");
  const auto nq = static_cast<std::int64_t>(q_pos.size());
  const auto nk = static_cast<std::int64_t>(k_pos.size());
  std::vector<LoweredRect> out;
  std::int64_t qa = 0;
  while (qa < nq) {
    // One document: consecutive queries with the same bounds.
    std::int64_t qb = qa + 1, ka = 0, kb = nk;
    if (docs) {
      while (qb < nq && mask.doc_lo[qb] == mask.doc_lo[qa] && mask.doc_hi[qb] == mask.doc_hi[qa]) ++qb;
      if (mask.doc_lo[qa] >= mask.doc_hi[qa]) {  // padding rows see nothing
        qa = qb;
        continue;
      }
      ka = std::lower_bound(k_pos.begin(), k_pos.end(), mask.doc_lo[qa]) - k_pos.begin();
      kb = std::lower_bound(k_pos.begin(), k_pos.end(), mask.doc_hi[qa]) - k_pos.begin();
    } else {
      qb = nq;
    }
    if (ka < kb) lower_staircase(out, q_pos, k_pos, qa, qb, ka, kb, mask);
    qa = qb;
  }
  return out;
}

std::vector<LoweredCall> lowered_calls(const std::vector<LoweredRect>& rects) {
  std::vector<LoweredCall> calls;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> rows;  // per call: its query row ranges
  for (const LoweredRect& r : rects) {
    bool placed = false;
    for (std::size_t c = 0; c < calls.size() && !placed; ++c) {
      if (calls[c].mask != r.mask) continue;
      const bool overlaps = std::any_of(rows[c].begin(), rows[c].end(),
                                        [&](const auto& q) { return r.q_begin < q.second && q.first < r.q_end; });
      if (overlaps) continue;
      calls[c].segments.push_back(r);
      rows[c].emplace_back(r.q_begin, r.q_end);
      placed = true;
    }
    if (!placed) {
      calls.push_back({r.mask, {r}});
      rows.push_back({{r.q_begin, r.q_end}});
    }
  }
  return calls;
}

std::string sdpa_mask_str(const SdpaMask& m) {
  std::ostringstream s;
  if (m.causal) {
    s << "causal " << (m.align == DiagonalAlignment::kBottomRight ? "bottom-right" : "top-left");
  } else {
    s << "no causal";
  }
  if (m.left_bound > 0) s << " left=" << m.left_bound;
  return s.str();
}

std::string sdpa_variant_fallback_reason(const MhaForwardArgs& args) {
  std::string why;
  auto add = [&why](const char* r) { why += (why.empty() ? "" : "; ") + std::string(r); };
  if (args.mods.softcap > 0.0f) add("soft-capping (cuDNN's score_mod replaces the rectangles' masks)");
  if (!args.mods.alibi_slopes.empty()) add("ALiBi (cuDNN's slopes are its own, on local indices)");
  if (!args.mods.sinks.empty()) add("sinks (joined once per row after the rectangles are merged)");
  if (args.dropout.p > 0.0) add("dropout (seqpar's Philox counter, not cuDNN's random stream)");
  return why;
}

}  // namespace seqpar::attn
