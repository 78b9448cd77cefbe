// DSA kernels and the fp64 reference with document bounds (attention/dsa.h DsaIndexerArgs::doc_lo / doc_hi,
// docs/design.md, "DSA on packed rows"): in a packed (and padded) row every document gets exactly what it gets alone through
// the unpacked path (topk_indices shifted by the document's first slot, out, lse, indexer loss per document, every
// gradient), padding rows select nothing and produce zeros and no NaN, and the fp64 reference (a per-pair document
// test) agrees with the kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention/dsa.h"
#include "attention/reference/dsa_reference.h"
#include "tests/util/dsa_packed.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using namespace test::dsa_packed;  // NOLINT(google-build-using-namespace): the helpers of this test

// Rows [from, from + n) of a [1, S, ...] vector with `row` values per row.
std::vector<double> rows_of(const std::vector<double>& v, std::int64_t row, std::int64_t from, std::int64_t n) {
  return {v.begin() + from * row, v.begin() + (from + n) * row};
}
// Columns [from, from + n) of lse [1, H, S].
std::vector<double> lse_cols(const std::vector<double>& lse, std::int64_t S, std::int64_t from, std::int64_t n) {
  std::vector<double> r;
  for (std::int64_t h = 0; h < H; ++h) r.insert(r.end(), lse.begin() + h * S + from, lse.begin() + h * S + from + n);
  return r;
}

// A packed, padded row: document d holds lens[d] real rows then pad[d] padding rows (slots = row indices).
struct Row {
  std::vector<std::int64_t> lens, pad;
  std::int64_t slots() const {
    std::int64_t n = 0;
    for (std::size_t d = 0; d < lens.size(); ++d) n += lens[d] + pad[d];
    return n;
  }
};

void expect_each_document_alone(const Row& row, DType dtype, std::int64_t K, std::uint64_t seed,
                                std::int64_t window = 0) {
  const std::int64_t S = row.slots();
  Inputs in(S, dtype, seed);
  Pos lo, hi;
  std::vector<bool> padding;
  for (std::size_t d = 0, s0 = 0; d < row.lens.size(); ++d) {
    const std::int64_t start = static_cast<std::int64_t>(s0), end = start + row.lens[d];
    for (std::int64_t i = start; i < end + row.pad[d]; ++i) {
      const bool p = i >= end;
      padding.push_back(p);
      lo.push_back(p ? i : start);
      hi.push_back(p ? i : end);
    }
    s0 += static_cast<std::size_t>(row.lens[d] + row.pad[d]);
  }
  for (Tensor* t : in.all()) {  // padding rows are zero, as a layout's scatter makes them
    const std::int64_t per = t->numel() / S;
    for (std::int64_t i = 0; i < S; ++i) {
      if (!padding[static_cast<std::size_t>(i)]) continue;
      std::memset(static_cast<char*>(t->data()) + i * per * dtype_size(t->dtype()), 0,
                  static_cast<std::size_t>(per) * dtype_size(t->dtype()));
    }
  }
  const Result got = run(in, K, lo, hi, false, window);
  const double tol = dtype == DType::kFloat64 ? 1e-12 : 2e-5;
  const std::string what = str_cat(dtype_name(dtype), " S=", S, " K=", K, " window=", window);
  double loss_sum = 0.0;
  for (std::size_t d = 0, s0 = 0; d < row.lens.size(); ++d) {
    const std::int64_t start = static_cast<std::int64_t>(s0), n = row.lens[d];
    s0 += static_cast<std::size_t>(n + row.pad[d]);
    if (n == 0) continue;
    Inputs alone_in = in.rows(start, n);
    const Result alone = run(alone_in, K, {}, {}, false, window);
    const std::string doc = str_cat(what, " document ", d, " (len ", n, ")");
    for (std::int64_t i = 0; i < n * K; ++i) {
      const std::int64_t want = alone.topk[static_cast<std::size_t>(i)];
      ASSERT_EQ(got.topk[static_cast<std::size_t>(start * K + i)], want < 0 ? -1 : want + start)
          << doc << " slot " << i;
    }
    EXPECT_TRUE(test::all_close(rows_of(got.out, H * Dv, start, n), alone.out, tol, tol, doc + " out"));
    EXPECT_TRUE(test::all_close(lse_cols(got.lse, S, start, n), alone.lse, tol, tol, doc + " lse"));
    EXPECT_TRUE(test::all_close(rows_of(got.dq, H * Dqk, start, n), alone.dq, tol, tol, doc + " dq"));
    EXPECT_TRUE(test::all_close(rows_of(got.dc, Dqk, start, n), alone.dc, tol, tol, doc + " dc"));
    EXPECT_TRUE(test::all_close(rows_of(got.dq_idx, Hi * Di, start, n), alone.dq_idx, tol, tol, doc + " dq_idx"));
    EXPECT_TRUE(test::all_close(rows_of(got.dw, Hi, start, n), alone.dw, tol, tol, doc + " dw"));
    EXPECT_TRUE(test::all_close(rows_of(got.dk_idx, Di, start, n), alone.dk_idx, tol, tol, doc + " dk_idx"));
    // the loss per document: the dscores of its rows equal those of the document alone, and the totals add up
    EXPECT_TRUE(test::all_close(rows_of(got.dscores, K, start, n), alone.dscores, tol, tol, doc + " dscores"));
    loss_sum += alone.loss;
  }
  EXPECT_NEAR(got.loss, loss_sum, tol * (1.0 + std::abs(loss_sum))) << what << " loss";
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t i = 0; i < S; ++i) {
    const auto zero_row = [&](const std::vector<double>& v, std::int64_t per, const char* name) {
      for (std::int64_t e = 0; e < per; ++e) {
        const double x = v[static_cast<std::size_t>(i * per + e)];
        ASSERT_FALSE(std::isnan(x)) << what << " " << name << " row " << i;
        if (padding[static_cast<std::size_t>(i)]) {
          ASSERT_EQ(x, 0.0) << what << " padding " << name << " row " << i;
        }
      }
    };
    zero_row(got.out, H * Dv, "out");
    zero_row(got.dq, H * Dqk, "dq");
    zero_row(got.dc, Dqk, "dc");
    zero_row(got.dq_idx, Hi * Di, "dq_idx");
    zero_row(got.dw, Hi, "dw");
    zero_row(got.dk_idx, Di, "dk_idx");
    if (!padding[static_cast<std::size_t>(i)]) continue;
    for (std::int64_t s = 0; s < K; ++s) ASSERT_EQ(got.topk[static_cast<std::size_t>(i * K + s)], -1) << what;
    for (std::int64_t h = 0; h < H; ++h) ASSERT_EQ(got.lse[static_cast<std::size_t>(h * S + i)], -inf) << what;
  }
  if (dtype != DType::kFloat64) return;
  // The fp64 reference tests the document per (query, key) pair: an independent implementation of the bounds.
  const Result ref = run(in, K, lo, hi, true, window);
  EXPECT_EQ(got.topk, ref.topk) << what << " vs reference";
  EXPECT_TRUE(test::all_close(got.out, ref.out, 1e-12, 1e-12, what + " out vs reference"));
  EXPECT_TRUE(test::all_close(got.dq, ref.dq, 1e-11, 1e-11, what + " dq vs reference"));
  EXPECT_TRUE(test::all_close(got.dc, ref.dc, 1e-11, 1e-11, what + " dc vs reference"));
  EXPECT_TRUE(test::all_close(got.dq_idx, ref.dq_idx, 1e-11, 1e-11, what + " dq_idx vs reference"));
  EXPECT_TRUE(test::all_close(got.dw, ref.dw, 1e-11, 1e-11, what + " dw vs reference"));
  EXPECT_TRUE(test::all_close(got.dk_idx, ref.dk_idx, 1e-11, 1e-11, what + " dk_idx vs reference"));
  EXPECT_NEAR(got.loss, ref.loss, 1e-11 * (1.0 + std::abs(ref.loss))) << what;
}

// Documents shorter than k (topk padded with -1 inside them), of length 1, zero-length, one spanning the row, an odd
// total; with and without padding slots after documents.
TEST(DsaPackedKernel, EachDocumentAsIfAlone) {
  const std::vector<Row> rows = {
      {{37, 1, 0, 64, 3, 0, 90, 2}, {0, 0, 0, 0, 0, 0, 0, 0}},
      {{1, 1, 1, 1, 1}, {0, 0, 0, 0, 0}},
      {{197}, {0}},
      {{20, 5, 0, 33}, {3, 0, 2, 7}},
      {{0, 6, 1}, {4, 1, 0}},
  };
  std::uint64_t seed = 100;
  for (const Row& row : rows) {
    for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
      for (std::int64_t K : {8, 70}) expect_each_document_alone(row, dtype, K, seed += 10);
    }
  }
}

// A sliding window of the indexer counts from the document's own start (slot distances inside a document).
TEST(DsaPackedKernel, WindowInsideDocuments) {
  for (std::int64_t window : {1, 6, 40}) {
    expect_each_document_alone({{20, 5, 0, 33}, {3, 0, 2, 7}}, DType::kFloat64, 8, 300 + window, window);
  }
}

// A row of padding only selects nothing and its every output and gradient is 0, with no NaN.
TEST(DsaPackedKernel, PaddingOnly) { expect_each_document_alone({{0}, {9}}, DType::kFloat32, 4, 7); }

// Bounds of the wrong size are refused by name.
TEST(DsaPackedKernel, BoundsOfTheWrongSizeAreRefused) {
  Inputs in(10, DType::kFloat32, 3);
  const Pos short_lo(3, 0);
  attn::DsaIndexerArgs ia{in.q_idx, in.w, in.k_idx, {}, {}};
  ia.doc_lo = short_lo;
  ia.doc_hi = short_lo;
  Tensor topk = Tensor::empty({1, 10, 4}, DType::kInt64, MemCategory::kWorkspace);
  test::expect_error([&] { attn::dsa_indexer_topk(ia, topk.view()); }, "doc_lo / doc_hi");
}

}  // namespace
}  // namespace seqpar
