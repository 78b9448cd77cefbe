// MHA kernels and the fp64 reference with document bounds (attention/mha.h MaskSpec doc_lo / doc_hi, docs/design.md
// "MHA on packed rows"): a packed row equals each document run alone, padding queries and keys contribute nothing and
// produce no NaN, and visible_pairs counts only pairs inside documents.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "tests/util/mha_problem.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

// The whole packed row in one kernel call (or one reference call) with document bounds.
test::MhaResult packed_call(const test::MhaShape& s, const test::MhaProblem& p, const DocBounds& b, bool reference) {
  test::MhaShape masked = s;
  masked.mask.doc_lo = b.lo;
  masked.mask.doc_hi = b.hi;
  return reference ? test::reference_result(masked, p) : test::single_rank_result(masked, p);
}

TEST(MhaPackedKernel, EachDocumentAsIfAlone) {
  const std::vector<std::vector<std::int64_t>> rows = {{37, 1, 0, 64, 3, 0, 90, 2}, {1, 1, 1, 1, 1}, {200}, {65, 64}};
  for (const auto& lens : rows) {
    const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
    const DocBounds b = test::token_doc_bounds(cu);
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      for (attn::MaskSpec mask : {attn::MaskSpec{true, 0}, attn::MaskSpec{false, 0}, attn::MaskSpec{true, 7}}) {
        test::MhaShape s;
        s.batch = 1;
        s.seq = cu.back();
        s.hq = 4;
        s.hkv = 2;
        s.dim = 16;
        s.dtype = dtype;
        s.mask = mask;
        const test::MhaProblem p(s);
        const std::string what = str_cat(dtype_name(dtype), " T=", s.seq, mask.causal ? " causal" : " full",
                                         mask.window > 0 ? " window" : "");
        const test::MhaResult want = test::per_document_result(s, p, cu);
        const test::MhaResult got = packed_call(s, p, b, false);
        test::expect_mha_match(got, want, dtype == DType::kFloat64 ? DType::kFloat32 : dtype, what);
        if (dtype != DType::kFloat64) continue;
        // The fp64 reference tests the bounds per (query, key) pair: an independent implementation.
        const test::MhaResult ref = packed_call(s, p, b, true);
        test::expect_mha_close(got, ref, 1e-12, what + " vs reference");
      }
    }
  }
}

// Padding: queries with an empty range (lo == hi) get out 0, lse -inf and no gradient; zero key rows that no document
// holds get dk = dv = 0; nothing is NaN. Positions are slots with gaps (a padded layout's), keys beyond the queries.
TEST(MhaPackedKernel, PaddingRowsAreZeroAndNeverNaN) {
  const std::int64_t S = 70;
  test::MhaShape s;
  s.batch = 1;
  s.seq = S;
  s.hq = 2;
  s.hkv = 1;
  s.dim = 8;
  s.dtype = DType::kFloat32;
  test::MhaProblem p(s);
  // Slots 0..39 hold document 0 (tokens 0..29, slots 30..39 padding), 40..69 document 1 (40..59, 60..69 padding).
  DocBounds b;
  std::vector<bool> pad(S);
  for (std::int64_t i = 0; i < S; ++i) {
    const std::int64_t start = i < 40 ? 0 : 40, end = start + (i < 40 ? 30 : 20);
    pad[i] = i >= end;
    b.lo.push_back(pad[i] ? i : start);
    b.hi.push_back(pad[i] ? i : end);
  }
  // padding rows of q, k, v, dout are zero, as the layout's scatter makes them
  for (Tensor* t : {&p.q, &p.k, &p.v, &p.dout}) {
    const std::int64_t row = t->numel() / S;
    float* x = t->view().data_as<float>();
    for (std::int64_t i = 0; i < S; ++i) {
      if (pad[i]) std::fill(x + i * row, x + (i + 1) * row, 0.0f);
    }
  }
  for (bool causal : {true, false}) {
    s.mask = {causal, 0};
    const test::MhaResult got = packed_call(s, p, b, false);
    const std::int64_t qrow = s.hq * s.dim, krow = s.hkv * s.dim;
    for (std::int64_t i = 0; i < S; ++i) {
      for (std::int64_t e = 0; e < qrow; ++e) {
        ASSERT_FALSE(std::isnan(got.out[i * qrow + e]) || std::isnan(got.dq[i * qrow + e]));
        if (pad[i]) {
          ASSERT_EQ(got.out[i * qrow + e], 0.0) << "row " << i;
          ASSERT_EQ(got.dq[i * qrow + e], 0.0) << "row " << i;
        }
      }
      for (std::int64_t e = 0; e < krow; ++e) {
        ASSERT_FALSE(std::isnan(got.dk[i * krow + e]) || std::isnan(got.dv[i * krow + e]));
        if (pad[i]) {
          ASSERT_EQ(got.dk[i * krow + e], 0.0) << "row " << i;
          ASSERT_EQ(got.dv[i * krow + e], 0.0) << "row " << i;
        }
      }
      for (std::int64_t h = 0; h < s.hq; ++h) {
        if (pad[i]) {
          ASSERT_EQ(got.lse[h * S + i], -std::numeric_limits<double>::infinity());
        }
      }
    }
  }
}

TEST(MhaPackedKernel, VisiblePairsCountOnlyInsideDocuments) {
  const std::vector<std::int64_t> cu = {0, 5, 5, 12};
  const DocBounds b = test::token_doc_bounds(cu);
  std::vector<std::int64_t> pos(12);
  std::iota(pos.begin(), pos.end(), 0);
  EXPECT_EQ(attn::visible_pairs(pos, pos, {true, 0, b.lo, b.hi}), 5 * 6 / 2 + 7 * 8 / 2);
  EXPECT_EQ(attn::visible_pairs(pos, pos, {false, 0, b.lo, b.hi}), 5 * 5 + 7 * 7);
  EXPECT_EQ(attn::visible_pairs(pos, pos, {true, 2, b.lo, b.hi}), 5 + 4 + 7 + 6);
  // bounds of the wrong size are refused by name
  const std::vector<std::int64_t> short_lo(3, 0);
  EXPECT_THROW(attn::visible_pairs(pos, pos, {true, 0, short_lo, short_lo}), Error);
}

}  // namespace
}  // namespace seqpar
