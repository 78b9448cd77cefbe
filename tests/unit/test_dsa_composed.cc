// The DSA indexer top-k composed from the ops table (attention/ops/dsa_composed.h) on the CPU table, against the
// naive fp64 reference (attention/reference/dsa_reference.h): the selected positions exactly (random scores have no
// near-ties at fp32 rounding; integer inputs make exact ties that the lower-position rule decides), and the scores at
// 1e-12 (fp64) / 1e-4 (fp32), with -inf exactly outside the candidates; windows, non-contiguous key positions,
// shuffled query positions, document bounds and k above the candidate count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "attention/dsa.h"
#include "attention/ops/dsa_composed.h"
#include "attention/reference/dsa_reference.h"
#include "tests/util/test_util.h"

namespace seqpar::attn {
namespace {

using test::random_tensor, test::to_double;
constexpr MemCategory kWs = MemCategory::kWorkspace;

struct Case {
  std::int64_t B = 2, Sq = 24, Sk = 30, Hi = 4, Di = 8, k = 7, window = 0;
  bool positions = false, docs = false, integer = false;
};

void check(const Case& c, DType dtype, std::uint64_t seed) {
  Tensor q = random_tensor({c.B, c.Sq, c.Hi, c.Di}, dtype, seed + 1);
  Tensor w = random_tensor({c.B, c.Sq, c.Hi}, dtype, seed + 2, 0.0, 1.0);
  Tensor k = random_tensor({c.B, c.Sk, c.Di}, dtype, seed + 3);
  if (c.integer) {  // small integers: scores exact in fp32, many equal
    for (Tensor* t : {&q, &w, &k}) {
      auto v = to_double(*t);
      for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = std::floor(2.0 * v[i]);
    }
  }
  std::vector<std::int64_t> qpos, kpos, lo, hi;
  if (c.positions) {  // keys at even positions; queries at positions 0..2 Sq in a shuffled order
    for (std::int64_t j = 0; j < c.Sk; ++j) kpos.push_back(2 * j);
    for (std::int64_t t = 0; t < c.Sq; ++t) qpos.push_back((t * 7) % c.Sq * 2 + 1);
  }
  if (c.docs) {  // documents of 9 positions; the query at t belongs to the document of its position
    for (std::int64_t t = 0; t < c.Sq; ++t) {
      const std::int64_t p = qpos.empty() ? t : qpos[t];
      lo.push_back(p / 9 * 9);
      hi.push_back(p / 9 * 9 + 9);
    }
    hi[1] = lo[1];  // a padding query: no candidate
  }
  const DsaIndexerArgs args{q, w, k, qpos, kpos, c.window, lo, hi};
  const DType sd = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor got = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs), want = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
  Tensor got_s = Tensor::empty({c.B, c.Sq, c.Sk}, sd, kWs), want_s = Tensor::empty({c.B, c.Sq, c.Sk}, DType::kFloat64, kWs);
  ops::dsa_indexer_topk_composed_cpu(args, got, got_s);
  const Tensor q64 = Tensor::copy_of(q, DType::kFloat64, kWs), w64 = Tensor::copy_of(w, DType::kFloat64, kWs),
               k64 = Tensor::copy_of(k, DType::kFloat64, kWs);
  const DsaIndexerArgs args64{q64, w64, k64, qpos, kpos, c.window, lo, hi};
  reference::dsa_indexer_topk(args64, want);
  reference::dsa_indexer_scores(args64, want_s);
  const std::int64_t* g = got.data_as<std::int64_t>();
  const std::int64_t* wt = want.data_as<std::int64_t>();
  EXPECT_EQ(std::vector<std::int64_t>(wt, wt + want.numel()), std::vector<std::int64_t>(g, g + got.numel()));
  const auto gs = to_double(got_s), ws = to_double(want_s);
  const double atol = dtype == DType::kFloat64 ? 1e-12 : 1e-4;
  std::int64_t selected = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) selected += g[i] >= 0;
  EXPECT_GT(selected, 0);
  for (std::size_t i = 0; i < gs.size(); ++i) {
    if (std::isinf(ws[i]))
      EXPECT_EQ(ws[i], gs[i]) << "score " << i;
    else
      EXPECT_NEAR(ws[i], gs[i], atol) << "score " << i;
  }
}

TEST(DsaComposed, TopkAndScoresMatchReference) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16}) {
    check(Case{}, dtype, 10);
    check(Case{.k = 40}, dtype, 20);  // k above every candidate count: -1 padding
  }
}

TEST(DsaComposed, WindowPositionsAndDocuments) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32}) {
    check(Case{.window = 5}, dtype, 30);
    check(Case{.positions = true}, dtype, 40);
    check(Case{.window = 6, .positions = true, .docs = true}, dtype, 50);
    check(Case{.docs = true}, dtype, 60);
  }
}

TEST(DsaComposed, ExactTiesGoToTheLowerPosition) {
  check(Case{.Sq = 32, .Sk = 32, .Hi = 2, .Di = 3, .k = 5, .integer = true}, DType::kFloat32, 70);
}

TEST(DsaComposed, ArgumentErrors) {
  Tensor q = random_tensor({1, 4, 2, 3}, DType::kFloat32, 1), w = random_tensor({1, 4, 2}, DType::kFloat32, 2),
         k = random_tensor({1, 5, 3}, DType::kFloat32, 3);
  Tensor bad = Tensor::empty({1, 3, 2}, DType::kInt64, kWs);
  test::expect_error([&] { ops::dsa_indexer_topk_composed_cpu({q, w, k, {}, {}}, bad); }, "topk_indices");
}

}  // namespace
}  // namespace seqpar::attn
