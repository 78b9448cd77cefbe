// The DSA indexer top-k composed from the ops table (attention/ops/dsa_composed.h) on the selected table, against the
// naive fp64 reference (attention/reference/dsa_reference.h): the selected positions exactly (random scores have no
// near-ties at fp32 rounding; integer inputs make exact ties that the lower-position rule decides), and the scores at
// 1e-12 (fp64) / 1e-4 (fp32), with -inf exactly outside the candidates; windows, non-contiguous key positions,
// shuffled query positions, document bounds and k above the candidate count. The composed sparse latent attention
// forward against the fp64 reference (1e-12) and the CPU kernel (fp32, bf16 inputs: 2e-5), on the whole latent set
// and on a block that misses some selections, with a row that selects nothing (lse = -inf, out = 0).
// The table: the CPU one, or the CUDA one with SEQPAR_TEST_DEVICE=cuda (tests/util/ops_table.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "attention/dsa.h"
#include "attention/ops/dsa_composed.h"
#include "attention/reference/dsa_reference.h"
#include "tests/util/ops_table.h"
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
  Tensor got = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs),
         want = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
  Tensor got_s = Tensor::empty({c.B, c.Sq, c.Sk}, sd, kWs),
         want_s = Tensor::empty({c.B, c.Sq, c.Sk}, DType::kFloat64, kWs);
  test::composed::dsa_indexer_topk(args, got, got_s);
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

// ---- sparse latent attention forward ----

struct AttnCase {
  std::int64_t B = 2, Sq = 12, Sk = 20, H = 3, Dqk = 10, Dv = 6, k = 5;
  bool block = false;  // c holds only the latents at odd positions (a ring block); some selections miss it
};

void check_attention(const AttnCase& c, DType dtype, std::uint64_t seed) {
  // queries at positions Sk - Sq .. Sk - 1; each selects up to k random earlier positions (ascending, -1 padded)
  std::vector<std::int64_t> qpos(c.Sq), cpos;
  for (std::int64_t t = 0; t < c.Sq; ++t) qpos[t] = c.Sk - c.Sq + t;
  Tensor topk = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
  std::int64_t* sel = topk.data_as<std::int64_t>();
  const auto pick = test::random_values(c.B * c.Sq * c.k, seed, 0.0, 1.0);
  for (std::int64_t r = 0; r < c.B * c.Sq; ++r) {
    const std::int64_t t = r % c.Sq;
    std::vector<std::int64_t> chosen;
    for (std::int64_t e = 0; e < c.k; ++e)
      chosen.push_back(static_cast<std::int64_t>(pick[r * c.k + e] * (qpos[t] + 1)));
    if (r == 3) chosen.clear();  // a row with nothing selected
    std::sort(chosen.begin(), chosen.end());
    chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    for (std::int64_t e = 0; e < c.k; ++e) sel[r * c.k + e] = e < std::ssize(chosen) ? chosen[e] : -1;
  }
  std::int64_t Sk = c.Sk;
  if (c.block) {
    for (std::int64_t j = 1; j < c.Sk; j += 2) cpos.push_back(j);
    Sk = std::ssize(cpos);
  }
  Tensor q = random_tensor({c.B, c.Sq, c.H, c.Dqk}, dtype, seed + 1);
  Tensor lat = random_tensor({c.B, Sk, c.Dqk}, dtype, seed + 2);
  const DsaAttentionArgs args{q, lat, topk, qpos, cpos, c.Dv};
  const DType acc = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor out = Tensor::empty({c.B, c.Sq, c.H, c.Dv}, acc, kWs), lse = Tensor::empty({c.B, c.H, c.Sq}, acc, kWs);
  test::composed::dsa_attention_forward(args, out, lse);
  Tensor want_o = Tensor::empty({c.B, c.Sq, c.H, c.Dv}, acc, kWs), want_l = Tensor::empty({c.B, c.H, c.Sq}, acc, kWs);
  double atol = 2e-5;
  if (dtype == DType::kFloat64) {  // the fp64 reference
    reference::dsa_attention_forward(args, want_o, want_l);
    atol = 1e-12;
  } else {  // the CPU kernel
    dsa_attention_forward(args, want_o, want_l);
  }
  const std::string tag = std::string(dtype_name(dtype)) + (c.block ? " block" : " whole");
  EXPECT_TRUE(test::all_close(to_double(out), to_double(want_o), atol, atol, tag + " out"));
  const auto gl = to_double(lse), wl = to_double(want_l);
  std::int64_t empty_rows = 0;
  for (std::size_t i = 0; i < gl.size(); ++i) {
    if (std::isinf(wl[i])) {
      ++empty_rows;
      EXPECT_EQ(wl[i], gl[i]) << tag << " lse " << i;
    } else {
      EXPECT_NEAR(wl[i], gl[i], atol) << tag << " lse " << i;
    }
  }
  EXPECT_GT(empty_rows, 0) << tag;  // the row with nothing selected
}

TEST(DsaComposed, AttentionForwardMatchesReferenceAndKernel) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16})
    for (bool block : {false, true}) check_attention(AttnCase{.block = block}, dtype, 80);
}

TEST(DsaComposed, ArgumentErrors) {
  Tensor q = random_tensor({1, 4, 2, 3}, DType::kFloat32, 1), w = random_tensor({1, 4, 2}, DType::kFloat32, 2),
         k = random_tensor({1, 5, 3}, DType::kFloat32, 3);
  Tensor bad = Tensor::empty({1, 3, 2}, DType::kInt64, kWs);
  test::expect_error([&] { test::composed::dsa_indexer_topk({q, w, k, {}, {}}, bad); }, "topk_indices");
}

}  // namespace
}  // namespace seqpar::attn
