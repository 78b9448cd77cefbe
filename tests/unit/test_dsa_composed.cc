// The DSA indexer top-k composed from the ops table (attention/ops/dsa_composed.h) on the selected table, against the
// naive fp64 reference (attention/reference/dsa_reference.h): the selected positions exactly (random scores have no
// near-ties at fp32 rounding; integer inputs make exact ties that the lower-position rule decides), and the scores at
// 1e-12 (fp64) / 1e-4 (fp32), with -inf exactly outside the candidates; windows, non-contiguous key positions,
// shuffled query positions, document bounds and k above the candidate count. The composed sparse latent attention
// forward against the fp64 reference (1e-12) and the CPU kernel (fp32, bf16 inputs: 2e-5), on the whole latent set
// and on a block that misses some selections, with a row that selects nothing (lse = -inf, out = 0). The selection
// again from three key blocks through the composed running state and merge. The composed backward (dq, dc, probs)
// against the fp64 reference and the CPU kernel, whole and block, accumulate; the composed indexer loss pipeline
// against the fp64 reference; the backwards bitwise repeatable across runs and thread counts.
// The table: the CPU one, or the CUDA one with SEQPAR_TEST_DEVICE=cuda (tests/util/ops_table.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "attention/dsa.h"
#include "attention/ops/dsa_composed.h"
#include "attention/reference/dsa_reference.h"
#include "tests/util/dsa_problem.h"
#include "tests/util/ops_table.h"
#include "tests/util/test_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// OpenBLAS's thread count, when the CPU ops table runs on OpenBLAS (a weak reference: null otherwise).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

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

  // The same selection from three interleaved key blocks (key j in block j % 3) fed in the order 2, 0, 1 into one
  // running state, and from blocks 0 and 1 + 2 in two states merged (the composed block top-k and merge), finalised.
  const std::vector<std::int64_t> kp_all = kpos.empty() ? [&] {
    std::vector<std::int64_t> v(c.Sk);
    std::iota(v.begin(), v.end(), 0);
    return v;
  }() : kpos;
  std::vector<Tensor> kb(3);
  std::vector<std::vector<std::int64_t>> kb_pos(3);
  const std::size_t es = dtype_size(dtype);
  for (int m = 0; m < 3; ++m) {
    std::vector<std::int64_t> js;
    for (std::int64_t j = m; j < c.Sk; j += 3) js.push_back(j);
    kb[m] = Tensor::empty({c.B, std::ssize(js), c.Di}, dtype, kWs);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::size_t i = 0; i < js.size(); ++i)
        std::memcpy(
            static_cast<char*>(kb[m].data()) + ((b * std::ssize(js) + static_cast<std::int64_t>(i)) * c.Di) * es,
            static_cast<const char*>(k.data()) + ((b * c.Sk + js[i]) * c.Di) * es, c.Di * es);
    for (std::int64_t j : js) kb_pos[m].push_back(kp_all[j]);
  }
  Tensor s1 = Tensor::empty({c.B, c.Sq, c.k}, sd, kWs), p1 = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs),
         s2 = Tensor::empty({c.B, c.Sq, c.k}, sd, kWs), p2 = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs),
         s3 = Tensor::empty({c.B, c.Sq, c.k}, sd, kWs), p3 = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
  const DsaTopkState one{s1, p1}, first{s2, p2}, rest{s3, p3};
  for (const DsaTopkState& st : {one, first, rest}) dsa_topk_init(st);
  auto block_args = [&](int m) { return DsaIndexerArgs{q, w, kb[m], qpos, kb_pos[m], c.window, lo, hi}; };
  for (int m : {2, 0, 1}) test::composed::dsa_topk_block(block_args(m), one);
  test::composed::dsa_topk_block(block_args(0), first);
  test::composed::dsa_topk_block(block_args(1), rest);
  test::composed::dsa_topk_block(block_args(2), rest);
  test::composed::dsa_topk_merge(first, rest);
  for (const DsaTopkState& st : {one, first}) {
    Tensor fin = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
    dsa_topk_finalize(st, fin);
    const std::int64_t* f = fin.data_as<std::int64_t>();
    EXPECT_EQ(std::vector<std::int64_t>(wt, wt + want.numel()), std::vector<std::int64_t>(f, f + fin.numel()))
        << "blocks through the running state";
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

// queries at positions Sk - Sq .. Sk - 1; each selects up to k random earlier positions (ascending, -1 padded); row 3
// selects nothing; with c.block, the latents of the odd positions only.
struct AttnProblem {
  std::vector<std::int64_t> qpos, cpos;
  Tensor topk, q, lat;
  AttnProblem(const AttnCase& c, DType dtype, std::uint64_t seed) : qpos(c.Sq) {
    for (std::int64_t t = 0; t < c.Sq; ++t) qpos[t] = c.Sk - c.Sq + t;
    topk = Tensor::empty({c.B, c.Sq, c.k}, DType::kInt64, kWs);
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
    q = random_tensor({c.B, c.Sq, c.H, c.Dqk}, dtype, seed + 1);
    lat = random_tensor({c.B, Sk, c.Dqk}, dtype, seed + 2);
  }
  DsaAttentionArgs args(const AttnCase& c) const { return {q, lat, topk, qpos, cpos, c.Dv}; }
};

void check_attention(const AttnCase& c, DType dtype, std::uint64_t seed) {
  const AttnProblem pr(c, dtype, seed);
  const DsaAttentionArgs args = pr.args(c);
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

// ---- sparse latent attention backward ----

// The composed backward (probs fused) with the final out and lse of the CPU kernel's forward: against the fp64
// reference for fp64 inputs (1e-12 relative to each tensor's largest element), against the CPU kernel's backward for
// fp32 and bf16 inputs (both compute in fp32: 2e-5), on the whole latent set and on a block that misses some
// selections; accumulate = true adds exactly the same values again.
void check_backward(const AttnCase& c, DType dtype, std::uint64_t seed) {
  const AttnProblem pr(c, dtype, seed);
  const DsaAttentionArgs args = pr.args(c);
  const DType acc = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor out = Tensor::empty({c.B, c.Sq, c.H, c.Dv}, acc, kWs), lse = Tensor::empty({c.B, c.H, c.Sq}, acc, kWs);
  dsa_attention_forward(args, out, lse);
  const Tensor dout = random_tensor(out.shape(), dtype, seed + 3);
  Tensor delta = Tensor::empty(lse.shape(), acc, kWs);
  dsa_attention_delta(out, dout, delta);
  auto zeros = [&](const Shape& s) { return Tensor::zeros(s, acc, kWs); };
  Tensor dq = zeros(pr.q.shape()), dc = zeros(pr.lat.shape()), probs = zeros(pr.topk.shape());
  test::composed::dsa_attention_backward(args, lse, dout, delta, dq, dc, false, probs);
  Tensor dq_k = zeros(pr.q.shape()), dc_k = zeros(pr.lat.shape()), probs_k = zeros(pr.topk.shape());
  dsa_attention_backward({args, out, dout, lse, delta, probs_k}, dq_k, dc_k, false);
  const std::string tag = std::string(dtype_name(dtype)) + (c.block ? " block" : " whole");
  if (dtype == DType::kFloat64) {
    Tensor dq_r = zeros(pr.q.shape()), dc_r = zeros(pr.lat.shape());
    reference::dsa_attention_backward(args, dout, dq_r, dc_r);
    EXPECT_TRUE(test::rel_close(to_double(dq), to_double(dq_r), 1e-12, tag + " dq vs reference"));
    EXPECT_TRUE(test::rel_close(to_double(dc), to_double(dc_r), 1e-12, tag + " dc vs reference"));
  }
  const double rel = dtype == DType::kFloat64 ? 1e-12 : 2e-5;
  EXPECT_TRUE(test::rel_close(to_double(dq), to_double(dq_k), rel, tag + " dq vs kernel"));
  EXPECT_TRUE(test::rel_close(to_double(dc), to_double(dc_k), rel, tag + " dc vs kernel"));
  EXPECT_TRUE(test::rel_close(to_double(probs), to_double(probs_k), rel, tag + " probs vs kernel"));
  double mass = 0.0;
  for (double v : to_double(probs)) mass += v;
  EXPECT_GT(mass, 1.0) << tag;  // probabilities of several rows landed in probs
  // accumulate: the same values added once more (x + x = 2x exactly)
  Tensor dq2 = Tensor::copy_of(dq, acc, kWs), dc2 = Tensor::copy_of(dc, acc, kWs);
  test::composed::dsa_attention_backward(args, lse, dout, delta, dq2, dc2, true, {});
  auto twice = [](std::vector<double> v) {
    for (double& x : v) x *= 2;
    return v;
  };
  EXPECT_EQ(twice(to_double(dq)), to_double(dq2)) << tag;
  EXPECT_EQ(twice(to_double(dc)), to_double(dc2)) << tag;
}

TEST(DsaComposed, AttentionBackwardMatchesReferenceAndKernel) {
  for (DType dtype : {DType::kFloat64, DType::kFloat32, DType::kBFloat16})
    for (bool block : {false, true}) check_backward(AttnCase{.block = block}, dtype, 90);
}

// Wide latents (Dqk 576, k 100): the compositions take their 300 queries in two chunks (2^24 elements of gathered
// rows at most per chunk), the forward and the backward against the CPU kernel.
TEST(DsaComposed, AttentionInQueryChunksMatchesKernel) {
  const AttnCase c{.B = 1, .Sq = 300, .Sk = 320, .H = 2, .Dqk = 576, .Dv = 16, .k = 100};
  check_attention(c, DType::kFloat32, 95);
  check_backward(c, DType::kFloat32, 96);
}

// ---- indexer loss and backward ----

// The indexer loss pipeline composed (probs from the composed attention backward, selected scores, KL loss, indexer
// backward) against the fp64 reference's loss and gradients (fp64: 1e-10 relative to each tensor's largest element;
// fp32: 1e-4), on the reference's selection.
void check_indexer_loss(DType dtype, std::uint64_t seed) {
  const std::int64_t B = 2, S = 30, H = 3, Dqk = 10, Dv = 6, Hi = 4, Di = 8, k = 7;
  const Tensor q = random_tensor({B, S, H, Dqk}, dtype, seed), c = random_tensor({B, S, Dqk}, dtype, seed + 1),
               qi = random_tensor({B, S, Hi, Di}, dtype, seed + 2),
               w = random_tensor({B, S, Hi}, dtype, seed + 3, 0, 1), ki = random_tensor({B, S, Di}, dtype, seed + 4);
  const Tensor q64 = Tensor::copy_of(q, DType::kFloat64, kWs), c64 = Tensor::copy_of(c, DType::kFloat64, kWs),
               qi64 = Tensor::copy_of(qi, DType::kFloat64, kWs), w64 = Tensor::copy_of(w, DType::kFloat64, kWs),
               ki64 = Tensor::copy_of(ki, DType::kFloat64, kWs);
  const DsaIndexerArgs ia{qi, w, ki, {}, {}};
  Tensor topk = Tensor::empty({B, S, k}, DType::kInt64, kWs);
  reference::dsa_indexer_topk({qi64, w64, ki64, {}, {}}, topk);
  const DsaAttentionArgs aa{q, c, topk, {}, {}, Dv};
  const DType acc = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  auto zeros = [&](const Shape& s) { return Tensor::zeros(s, acc, kWs); };
  Tensor out = zeros({B, S, H, Dv}), lse = zeros({B, H, S});
  dsa_attention_forward(aa, out, lse);
  Tensor probs = zeros(topk.shape()), scores = zeros(topk.shape()), dscores = zeros(topk.shape());
  test::composed::dsa_attention_backward(aa, lse, {}, {}, {}, {}, false, probs);
  test::composed::dsa_indexer_scores_selected(ia, topk, scores);
  const double loss = test::composed::dsa_indexer_loss({probs, scores, topk}, dscores);
  Tensor dqi = zeros(qi.shape()), dw = zeros(w.shape()), dki = zeros(ki.shape());
  test::composed::dsa_indexer_backward(ia, topk, dscores, dqi, dw, dki, true);

  Tensor dqi_r = Tensor::zeros(qi.shape(), DType::kFloat64, kWs), dw_r = Tensor::zeros(w.shape(), DType::kFloat64, kWs),
         dki_r = Tensor::zeros(ki.shape(), DType::kFloat64, kWs);
  const double loss_r =
      reference::dsa_indexer_loss({q64, c64, topk, {}, {}, Dv}, {qi64, w64, ki64, {}, {}}, dqi_r, dw_r, dki_r);
  const double rel = dtype == DType::kFloat64 ? 1e-10 : 1e-4;
  const std::string tag = dtype_name(dtype);
  EXPECT_GT(loss_r, 0.1) << tag;
  EXPECT_NEAR(loss, loss_r, rel * loss_r) << tag;
  EXPECT_TRUE(test::rel_close(to_double(dqi), to_double(dqi_r), rel, tag + " dq_idx"));
  EXPECT_TRUE(test::rel_close(to_double(dw), to_double(dw_r), rel, tag + " dw"));
  EXPECT_TRUE(test::rel_close(to_double(dki), to_double(dki_r), rel, tag + " dk_idx"));
}

TEST(DsaComposed, IndexerLossAndBackwardMatchReference) {
  check_indexer_loss(DType::kFloat64, 100);
  check_indexer_loss(DType::kFloat32, 110);
}

// ---- determinism ----

// The composed backwards (attention: dq, dc, probs; indexer: dq_idx, dw, dk_idx) are bitwise the same on a second
// run and with other thread counts (OpenMP 1 and 3, and OpenBLAS's own threads 1 and 3 where the CPU table runs on
// OpenBLAS): dc and dk_idx are summed per latent / key row over its inverted index in ascending slot order, never
// by atomics. Many queries select the same rows here (k = 12 of at most 64 keys, 80 queries).
TEST(DsaComposed, BackwardIsBitwiseRepeatableAcrossRunsAndThreadCounts) {
  const AttnCase c{.B = 2, .Sq = 40, .Sk = 64, .H = 4, .Dqk = 40, .Dv = 32, .k = 12};
  const AttnProblem pr(c, DType::kFloat32, 120);
  const DsaAttentionArgs args = pr.args(c);
  Tensor out = Tensor::empty({c.B, c.Sq, c.H, c.Dv}, DType::kFloat32, kWs),
         lse = Tensor::empty({c.B, c.H, c.Sq}, DType::kFloat32, kWs);
  dsa_attention_forward(args, out, lse);
  const Tensor dout = random_tensor(out.shape(), DType::kFloat32, 121);
  Tensor delta = Tensor::empty(lse.shape(), DType::kFloat32, kWs);
  dsa_attention_delta(out, dout, delta);
  const Tensor qi = random_tensor({c.B, c.Sq, 4, 16}, DType::kFloat32, 122),
               w = random_tensor({c.B, c.Sq, 4}, DType::kFloat32, 123, 0, 1),
               ki = random_tensor({c.B, c.Sk, 16}, DType::kFloat32, 124),
               g = random_tensor(pr.topk.shape(), DType::kFloat32, 125);
  const DsaIndexerArgs ia{qi, w, ki, pr.qpos, {}};
  auto run = [&](int threads) {
#ifdef _OPENMP
    const int keep = omp_get_max_threads();
    omp_set_num_threads(threads);
#endif
    if (openblas_set_num_threads != nullptr) openblas_set_num_threads(threads);
    auto zeros = [](const Shape& s) { return Tensor::zeros(s, DType::kFloat32, kWs); };
    Tensor dq = zeros(pr.q.shape()), dc = zeros(pr.lat.shape()), probs = zeros(pr.topk.shape());
    test::composed::dsa_attention_backward(args, lse, dout, delta, dq, dc, false, probs);
    Tensor dqi = zeros(qi.shape()), dw = zeros(w.shape()), dki = zeros(ki.shape());
    test::composed::dsa_indexer_backward(ia, pr.topk, g, dqi, dw, dki, false);
#ifdef _OPENMP
    omp_set_num_threads(keep);
#endif
    return std::vector<std::vector<double>>{to_double(dq),  to_double(dc), to_double(probs),
                                            to_double(dqi), to_double(dw), to_double(dki)};
  };
  const auto first = run(1), again = run(1), three = run(3);
  const char* names[] = {"dq", "dc", "probs", "dq_idx", "dw", "dk_idx"};
  for (std::size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(first[i], again[i]) << names[i] << " differs between two runs";
    EXPECT_EQ(first[i], three[i]) << names[i] << " depends on the thread count";
  }
}

TEST(DsaComposed, ArgumentErrors) {
  Tensor q = random_tensor({1, 4, 2, 3}, DType::kFloat32, 1), w = random_tensor({1, 4, 2}, DType::kFloat32, 2),
         k = random_tensor({1, 5, 3}, DType::kFloat32, 3);
  Tensor bad = Tensor::empty({1, 3, 2}, DType::kInt64, kWs);
  test::expect_error([&] { test::composed::dsa_indexer_topk({q, w, k, {}, {}}, bad); }, "topk_indices");
  // the compositions raise the boundary's errors before any work: a top-k state narrower than fp64 inputs' scores,
  // a selection that is not ascending
  const Tensor q64 = Tensor::copy_of(q, DType::kFloat64, kWs), w64 = Tensor::copy_of(w, DType::kFloat64, kWs),
               k64 = Tensor::copy_of(k, DType::kFloat64, kWs);
  Tensor sc = Tensor::zeros({1, 4, 2}, DType::kFloat32, kWs), ps = Tensor::zeros({1, 4, 2}, DType::kInt64, kWs);
  test::expect_error(
      [&] {
        test::composed::dsa_topk_block({q64, w64, k64, {}, {}}, {sc, ps});
      },
      "top-k state scores (fp64 indexer inputs) has dtype fp32, expected fp64");
  Tensor topk = Tensor::zeros({1, 4, 2}, DType::kInt64, kWs);
  topk.data_as<std::int64_t>()[6] = 3;  // row t = 3: positions 3, 0: not ascending
  Tensor lat = random_tensor({1, 5, 3}, DType::kFloat32, 4), lse = Tensor::zeros({1, 2, 4}, DType::kFloat32, kWs);
  Tensor probs = Tensor::zeros({1, 4, 2}, DType::kFloat32, kWs);
  test::expect_error(
      [&] {
        test::composed::dsa_attention_backward({q, lat, topk, {}, {}, 2}, lse, {}, {}, {}, {}, false, probs);
      },
      "must be strictly ascending");
}

}  // namespace
}  // namespace seqpar::attn
