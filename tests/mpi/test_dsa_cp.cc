// DSA under context parallelism against the single-rank problem: top-k indices bitwise equal to one kernel call
// over the whole sequence, and out, lse, loss, dq, dc, dq_idx, dk_idx, dw against the dense fp64 reference with
// those indices; ring and all-gather selection, ring sizes 1..8, USP grids, contiguous and zigzag, B = 2.
// At large logits (1e2 .. 1e4, attention and indexer): fp64 inputs select exactly the fp64 reference's keys and
// every output is within 1e-10 of the fp64 reference; fp32 inputs are, distributed, within 2x of the one-rank
// error against the fp64 reference. message_rounds against its closed form.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include "attention/mha.h"
#include "attention/reference/dsa_reference.h"
#include "attention/reference/mha_reference.h"
#include "parallel/dsa_cp.h"
#include "runtime/cp_grid.h"
#include "tests/util/dsa_problem.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::all_close;
using test::to_double;
using test::world;

constexpr std::int64_t kB = 2, kH = 4, kDqk = 32, kDv = 16, kHi = 2, kDi = 16;

struct DsaCase {
  int ulysses_size;
  LayoutKind layout;
  DsaSelectMode select;
  std::int64_t topk = 12;
  std::int64_t seq = 96;
  std::int64_t window = 0;  // > 0: the indexer's candidates are the last `window` keys of each query
};

std::string case_name(const DsaCase& c) {
  return str_cat("u", c.ulysses_size, "_", layout_name(c.layout), "_", dsa_select_mode_name(c.select), "_k", c.topk,
                 "_S", c.seq, c.window > 0 ? str_cat("_W", c.window) : std::string());
}
void PrintTo(const DsaCase& c, std::ostream* os) { *os << case_name(c); }

Tensor f64(const Tensor& t) { return Tensor::copy_of(t.view(), DType::kFloat64, MemCategory::kWorkspace); }

struct DsaProblem {
  Tensor q, c, q_idx, k_idx, w, dout;  // full, fp32 (or `dtype`)
  explicit DsaProblem(std::int64_t seq, std::uint64_t seed = 0) {
    q = test::random_tensor({kB, seq, kH, kDqk}, DType::kFloat32, 301 + seed);
    c = test::random_tensor({kB, seq, kDqk}, DType::kFloat32, 302 + seed);
    q_idx = test::random_tensor({kB, seq, kHi, kDi}, DType::kFloat32, 303 + seed);
    k_idx = test::random_tensor({kB, seq, kDi}, DType::kFloat32, 304 + seed);
    w = test::random_tensor({kB, seq, kHi}, DType::kFloat32, 305 + seed, 0.1, 1.0);
    dout = test::random_tensor({kB, seq, kH, kDv}, DType::kFloat32, 306 + seed);
  }
  // The same problem with the attention logits and the indexer scores scaled up to `logit`
  // (test::scale_to_large_logits), stored in `dtype` (the fp64 reference reads these rounded values).
  DsaProblem(std::int64_t seq, DType dtype, double logit) : DsaProblem(seq) {
    Tensor q64 = f64(q), c64 = f64(c), qi64 = f64(q_idx), w64 = f64(w), ki64 = f64(k_idx);
    test::scale_to_large_logits(q64, c64, qi64, w64, ki64, logit, logit);
    test::make_index_key_twins(ki64, 1e-9);  // fp64 selections that fp32-rounded scores would get wrong
    const auto store = [&](const Tensor& x) { return Tensor::copy_of(x.view(), dtype, MemCategory::kWorkspace); };
    q = store(q64);
    c = store(c64);
    q_idx = store(qi64);
    k_idx = store(ki64);
    w = store(w64);
    dout = store(dout);
  }
};

Tensor piece(const Tensor& full, const std::vector<std::int64_t>& pos) { return test::local_piece(full.view(), pos); }

std::vector<double> gather(Communicator& sp, const SequenceLayout& layout, const Tensor& local, const Shape& full,
                           int seq_dim = 1) {
  Tensor t = Tensor::empty(full, local.dtype(), MemCategory::kWorkspace);
  gather_sequence(sp, layout, local.view(), t.view(), seq_dim);
  return to_double(t);
}

struct DistResult {
  std::vector<double> out, lse, topk, dq, dc, dq_idx, dk_idx, dw;
  double loss = 0;
};

DistResult run_distributed(const CpGrid& grid, const DsaCase& c, const DsaProblem& p) {
  DsaCpConfig cfg;
  cfg.select = c.select;
  cfg.topk = c.topk;
  cfg.dim_v = kDv;
  cfg.window = c.window;
  const CpGroups groups = CpGroups::from(grid);
  DsaCp dsa(groups, SequenceLayout::for_groups(groups, c.seq, c.layout), cfg);
  const auto& pos = dsa.positions();
  Tensor q = piece(p.q, pos), cc = piece(p.c, pos), qi = piece(p.q_idx, pos), ki = piece(p.k_idx, pos),
         w = piece(p.w, pos), dout = piece(p.dout, pos);
  DsaCpOutput o = dsa.forward(q.view(), cc.view(), qi.view(), ki.view(), w.view());
  DsaCpGrads g = dsa.backward(std::move(o.ctx), dout.view());
  Communicator& sp = grid.cp();
  const SequenceLayout& L = dsa.layout();
  DistResult r;
  r.out = gather(sp, L, o.out, {kB, c.seq, kH, kDv});
  r.lse = gather(sp, L, o.lse, {kB, kH, c.seq}, 2);
  r.topk = gather(sp, L, o.topk_indices, {kB, c.seq, c.topk});
  r.dq = gather(sp, L, g.dq, p.q.shape());
  r.dc = gather(sp, L, g.dc, p.c.shape());
  r.dq_idx = gather(sp, L, g.dq_idx, p.q_idx.shape());
  r.dk_idx = gather(sp, L, g.dk_idx, p.k_idx.shape());
  r.dw = gather(sp, L, g.dw, p.w.shape());
  r.loss = g.loss;
  return r;
}

// Single-rank: top-k from one kernel call over the whole sequence (what every grid must reproduce bitwise).
Tensor single_rank_topk(const DsaProblem& p, std::int64_t seq, std::int64_t topk, std::int64_t window = 0) {
  attn::DsaIndexerArgs a;
  a.q_idx = p.q_idx.view();
  a.w = p.w.view();
  a.k_idx = p.k_idx.view();
  a.window = window;
  Tensor t = Tensor::empty({kB, seq, topk}, DType::kInt64, MemCategory::kWorkspace);
  attn::dsa_indexer_topk(a, t.view());
  return t;
}

// The fp64 dense reference (attn::reference) of the whole problem with the selection `topk` [B, S, k]; topk is
// returned as given.
DistResult fp64_reference(const DsaProblem& p, const DsaCase& c, const Tensor& topk) {
  Tensor q = f64(p.q), cc = f64(p.c), qi = f64(p.q_idx), ki = f64(p.k_idx), w = f64(p.w), dout = f64(p.dout);
  attn::DsaAttentionArgs aa;
  aa.q = q.view();
  aa.c = cc.view();
  aa.topk_indices = topk.view();
  aa.dim_v = kDv;
  Tensor out = Tensor::empty({kB, c.seq, kH, kDv}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({kB, kH, c.seq}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::dsa_attention_forward(aa, out.view(), lse.view());
  Tensor dq = Tensor::empty(q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dc = Tensor::empty(cc.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::dsa_attention_backward(aa, dout.view(), dq.view(), dc.view());
  attn::DsaIndexerArgs ia;
  ia.q_idx = qi.view();
  ia.w = w.view();
  ia.k_idx = ki.view();
  Tensor dqi = Tensor::empty(qi.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dw = Tensor::empty(w.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dki = Tensor::empty(ki.shape(), DType::kFloat64, MemCategory::kWorkspace);
  const double loss = attn::reference::dsa_indexer_loss(aa, ia, dqi.view(), dw.view(), dki.view());

  DistResult r;
  r.out = to_double(out);
  r.lse = to_double(lse);
  r.topk = to_double(topk);
  r.dq = to_double(dq);
  r.dc = to_double(dc);
  r.dq_idx = to_double(dqi);
  r.dk_idx = to_double(dki);
  r.dw = to_double(dw);
  r.loss = loss;
  return r;
}

class DsaCpVsSingleRank : public ::testing::TestWithParam<DsaCase> {};

TEST_P(DsaCpVsSingleRank, MatchesSingleRankProblem) {
  const DsaCase c = GetParam();
  CpGrid grid(world(), test::ulysses_over_world(c.ulysses_size));
  const DsaProblem p(c.seq);
  const DistResult got = run_distributed(grid, c, p);
  const std::string name = str_cat(case_name(c), " on ", grid.str());

  Tensor topk = single_rank_topk(p, c.seq, c.topk, c.window);
  EXPECT_EQ(got.topk, to_double(topk)) << name << ": topk_indices differ from the single-rank selection";

  const DistResult ref = fp64_reference(p, c, topk);
  // fp32 kernels against fp64: rounding only (O(1) values, sums over <= k keys and <= S queries).
  const double atol = 1e-4, rtol = 1e-3;
  EXPECT_TRUE(all_close(got.out, ref.out, atol, rtol, name + " out"));
  EXPECT_TRUE(all_close(got.lse, ref.lse, atol, rtol, name + " lse"));
  EXPECT_TRUE(all_close(got.dq, ref.dq, atol, rtol, name + " dq"));
  EXPECT_TRUE(all_close(got.dc, ref.dc, atol, rtol, name + " dc"));
  EXPECT_TRUE(all_close(got.dq_idx, ref.dq_idx, atol, rtol, name + " dq_idx"));
  EXPECT_TRUE(all_close(got.dk_idx, ref.dk_idx, atol, rtol, name + " dk_idx"));
  EXPECT_TRUE(all_close(got.dw, ref.dw, atol, rtol, name + " dw"));
  EXPECT_NEAR(got.loss, ref.loss, 1e-4 * std::max(1.0, std::abs(ref.loss))) << name << " loss";
}

std::vector<DsaCase> dsa_cases() {
  const int n = world().size();
  std::vector<DsaCase> cases;
  for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
    for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
      cases.push_back({1, layout, select});
      if (n % 2 == 0 && n >= 4) cases.push_back({2, layout, select});  // USP 2 x (n / 2)
    }
  }
  cases.push_back({1, LayoutKind::kZigzag, DsaSelectMode::kRing, 200});  // k > S
  // A window for the indexer's candidates: much smaller than, about and larger than S / P (S = 96).
  for (std::int64_t window : {5, 30, 200}) {
    for (LayoutKind layout : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
      for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
        cases.push_back({1, layout, select, 12, 96, window});
      }
    }
  }
  if (n % 2 == 0 && n >= 4) cases.push_back({2, LayoutKind::kZigzag, DsaSelectMode::kRing, 12, 96, 9});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(DsaCp, DsaCpVsSingleRank, ::testing::ValuesIn(dsa_cases()), test::CaseName());

// A non-finite scale is an error at construction (it used to be replaced silently by 1/sqrt(Dqk)).
TEST(DsaCp, NonFiniteScaleIsRefusedBeforeCommunication) {
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  DsaCpConfig cfg;
  cfg.scale = std::numeric_limits<float>::infinity();
  const CpGroups groups = CpGroups::from(grid);
  std::string message;
  try {
    DsaCp dsa(groups, SequenceLayout::for_groups(groups, 4 * n, LayoutKind::kContiguous), cfg);
  } catch (const Error& e) {
    message = e.message();
  }
  EXPECT_EQ(message, "DSA scale inf must be finite (0 or less: 1/sqrt(Dqk))");
}

// A topk no buffer can hold (2^46 entries per query row: 2^48 bytes of scores for one row, beyond any address space)
// fails on every rank before the selection's first message, naming topk and the keys a query selects among (it named
// only the bytes).
TEST(DsaCp, HugeTopkFailsNamingTopk) {
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  const std::int64_t seq = 4 * n;
  DsaCpConfig cfg;
  cfg.topk = std::int64_t{1} << 46;
  cfg.dim_v = kDv;
  const CpGroups groups = CpGroups::from(grid);
  DsaCp dsa(groups, SequenceLayout::for_groups(groups, seq, LayoutKind::kContiguous), cfg);
  const DsaProblem p(seq);
  const auto& pos = dsa.positions();
  Tensor q = piece(p.q, pos), cc = piece(p.c, pos), qi = piece(p.q_idx, pos), ki = piece(p.k_idx, pos),
         w = piece(p.w, pos);
  std::string message;
  try {
    (void)dsa.forward(q.view(), cc.view(), qi.view(), ki.view(), w.view());
  } catch (const Error& e) {
    message = e.message();
  }
  const std::string want = str_cat("DSA CP forward: topk 70368744177664: the top-k selection's buffers (topk entries ",
                                   "per query row) cannot be made; a query selects among at most ", seq,
                                   " keys, a larger topk adds only -1 padding (out of memory: allocating ");
  EXPECT_EQ(message.substr(0, want.size()), want) << message;
  EXPECT_TRUE(test::all_ranks(world(), message.starts_with(want)));
}

// k >= the number of visible keys: DSA is dense causal attention (MQA with the latent as key and value).
TEST(DsaCp, FullTopkIsDenseCausalAttention) {
  CpGrid grid(world(), test::ring_over_world());
  const DsaCase c{1, LayoutKind::kZigzag, DsaSelectMode::kRing, 96, 96};
  const DsaProblem p(c.seq);
  const DistResult got = run_distributed(grid, c, p);
  Tensor q = f64(p.q);
  Tensor k = Tensor::empty({kB, c.seq, 1, kDqk}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor v = Tensor::zeros({kB, c.seq, 1, kDqk}, DType::kFloat64, MemCategory::kWorkspace);
  const std::vector<double> cv = to_double(p.c);
  for (std::int64_t i = 0; i < kB * c.seq; ++i)
    for (std::int64_t d = 0; d < kDqk; ++d) {
      k.data_as<double>()[i * kDqk + d] = cv[i * kDqk + d];
      if (d < kDv) v.data_as<double>()[i * kDqk + d] = cv[i * kDqk + d];
    }
  attn::MhaForwardArgs a;
  a.q = q.view();
  a.k = k.view();
  a.v = v.view();
  a.mask = {true, 0};
  Tensor out = Tensor::empty({kB, c.seq, kH, kDqk}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({kB, kH, c.seq}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::mha_forward(a, out.view(), lse.view());
  std::vector<double> want;
  const std::vector<double> o = to_double(out);
  for (std::int64_t i = 0; i < kB * c.seq * kH; ++i)
    for (std::int64_t d = 0; d < kDv; ++d) want.push_back(o[i * kDqk + d]);
  EXPECT_TRUE(all_close(got.out, want, 1e-4, 1e-3, "dense-equivalent out"));
  EXPECT_TRUE(all_close(got.lse, to_double(lse), 1e-4, 1e-3, "dense-equivalent lse"));
}

// Equal scores everywhere: ties go to the smaller position, identically on every grid and run.
TEST(DsaCp, TiesAreDeterministicAcrossGridsAndRuns) {
  const int n = world().size();
  DsaProblem p(96);
  for (std::int64_t i = 0; i < p.k_idx.numel(); ++i) p.k_idx.data_as<float>()[i] = 0.25f;  // all keys equal
  for (int pu : {1, 2}) {
    if (n % pu != 0) continue;
    CpGrid grid(world(), {1, pu, n / pu, Placement::kUlyssesInner});
    for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
      const DsaCase c{pu, LayoutKind::kZigzag, select};
      const DistResult a = run_distributed(grid, c, p);
      const DistResult b = run_distributed(grid, c, p);
      EXPECT_EQ(a.topk, b.topk);
      EXPECT_EQ(a.out, b.out);
      EXPECT_EQ(a.dk_idx, b.dk_idx);
      // Expected: query t selects positions 0 .. min(t, k-1) when every score ties (independent construction).
      for (std::int64_t bt = 0; bt < kB * c.seq; ++bt) {
        const std::int64_t t = bt % c.seq;
        for (std::int64_t s = 0; s < c.topk; ++s) {
          const double want = s <= t ? static_cast<double>(s) : -1.0;
          ASSERT_EQ(a.topk[bt * c.topk + s], want) << "row " << bt << " slot " << s << " on " << grid.str();
        }
      }
    }
  }
}

// Changing tokens after position t leaves every output and index at positions <= t unchanged.
TEST(DsaCp, Causality) {
  CpGrid grid(world(), test::ring_over_world());
  const DsaCase c{1, LayoutKind::kZigzag, DsaSelectMode::kRing};
  const DsaProblem p(c.seq);
  DsaProblem changed(c.seq);
  const std::int64_t t_cut = 40;
  const DsaProblem other(c.seq, 1000);
  auto overwrite_tail = [&](Tensor& dst, const Tensor& src) {
    const std::int64_t row = dst.numel() / (kB * c.seq);
    for (std::int64_t b = 0; b < kB; ++b)
      for (std::int64_t t = t_cut + 1; t < c.seq; ++t)
        for (std::int64_t i = 0; i < row; ++i)
          dst.data_as<float>()[(b * c.seq + t) * row + i] = src.data_as<float>()[(b * c.seq + t) * row + i];
  };
  overwrite_tail(changed.q, other.q);
  overwrite_tail(changed.c, other.c);
  overwrite_tail(changed.q_idx, other.q_idx);
  overwrite_tail(changed.k_idx, other.k_idx);
  overwrite_tail(changed.w, other.w);
  const DistResult a = run_distributed(grid, c, p);
  const DistResult b = run_distributed(grid, c, changed);
  for (std::int64_t bb = 0; bb < kB; ++bb)
    for (std::int64_t t = 0; t <= t_cut; ++t) {
      for (std::int64_t s = 0; s < c.topk; ++s)
        ASSERT_EQ(a.topk[(bb * c.seq + t) * c.topk + s], b.topk[(bb * c.seq + t) * c.topk + s]) << "t=" << t;
      for (std::int64_t i = 0; i < kH * kDv; ++i)
        ASSERT_EQ(a.out[(bb * c.seq + t) * kH * kDv + i], b.out[(bb * c.seq + t) * kH * kDv + i]) << "t=" << t;
    }
}

// The indexer keeps O(S_local * k) state: doubling S at fixed k roughly doubles the forward's peak, not x4.
TEST(DsaCp, PeakMemoryIsLinearInSequence) {
  const int n = world().size();
  CpGrid grid(world(), test::ring_over_world());
  std::int64_t peaks[2];
  for (int i = 0; i < 2; ++i) {
    const std::int64_t seq = 2 * n * 48 * (i + 1);
    const DsaProblem p(seq);
    DsaCpConfig cfg;
    cfg.topk = 8;
    cfg.dim_v = kDv;
    const CpGroups groups = CpGroups::from(grid);
    DsaCp dsa(groups, SequenceLayout::for_groups(groups, seq), cfg);
    const auto& pos = dsa.positions();
    Tensor q = piece(p.q, pos), cc = piece(p.c, pos), qi = piece(p.q_idx, pos), ki = piece(p.k_idx, pos),
           w = piece(p.w, pos);
    const std::int64_t base = memory_ledger().snapshot().total_current;
    memory_ledger().reset_peaks();
    DsaCpOutput o = dsa.forward(q.view(), cc.view(), qi.view(), ki.view(), w.view());
    peaks[i] = memory_ledger().snapshot().total_peak - base;
  }
  EXPECT_LT(static_cast<double>(peaks[1]) / static_cast<double>(peaks[0]), 2.6)
      << "forward peak " << peaks[0] << " -> " << peaks[1] << " bytes when S doubles";
}

// ---- large logits (fp64 means fp64) ---------------------------------------------------------------------

constexpr double kLargeLogits[] = {1e2, 1e3, 1e4};

// The grids, layouts and selection modes of dsa_cases() at S = 48 and an odd k (so that the selection cuts the
// index-key twins of the large-logit problem).
std::vector<DsaCase> large_logit_cases() {
  std::vector<DsaCase> cases;
  for (DsaCase c : dsa_cases()) {
    if (c.window > 0) continue;  // the window has its own tests
    c.seq = 48;
    c.topk = c.topk > 12 ? 61 : 11;
    cases.push_back(c);
  }
  return cases;
}

CpGrid grid_of(const DsaCase& c) {
  return CpGrid(world(), test::ulysses_over_world(c.ulysses_size));
}

// The fp64 reference's own selection (attn::reference::dsa_indexer_topk on the problem's values).
Tensor reference_topk(const DsaProblem& p, const DsaCase& c) {
  Tensor qi = f64(p.q_idx), w = f64(p.w), ki = f64(p.k_idx);
  Tensor t = Tensor::empty({kB, c.seq, c.topk}, DType::kInt64, MemCategory::kWorkspace);
  attn::reference::dsa_indexer_topk({qi.view(), w.view(), ki.view(), {}, {}, c.window}, t.view());
  return t;
}

// Relative errors (test::rel_error) of every floating output, in DistResult order.
constexpr const char* kErrNames[] = {"out", "lse", "dq", "dc", "dq_idx", "dk_idx", "dw", "loss"};
std::vector<double> errors_of(const DistResult& got, const DistResult& ref) {
  return {test::rel_error(got.out, ref.out),       test::rel_error(got.lse, ref.lse),
          test::rel_error(got.dq, ref.dq),         test::rel_error(got.dc, ref.dc),
          test::rel_error(got.dq_idx, ref.dq_idx), test::rel_error(got.dk_idx, ref.dk_idx),
          test::rel_error(got.dw, ref.dw),         test::rel_error({got.loss}, {ref.loss})};
}

// Rank 0 prints one line of errors (the measured precision, for the logs).
void print_errors(const std::string& what, const std::vector<double>& err) {
  if (world().rank() != 0) return;
  std::string line = what + ":";
  for (std::size_t i = 0; i < err.size(); ++i) line += str_cat(" ", kErrNames[i], " ", err[i]);
  std::printf("%s\n", line.c_str());
}

// fp64 inputs select exactly the fp64 reference's keys, on every grid, layout and selection mode, with the ties of
// the fp32-rounded scores that the index-key twins create.
TEST(DsaCpLargeLogits, Fp64SelectsTheReferenceKeys) {
  for (double logit : kLargeLogits) {
    const DsaProblem p(48, DType::kFloat64, logit);
    for (const DsaCase& c : large_logit_cases()) {
      const DistResult got = run_distributed(grid_of(c), c, p);
      EXPECT_EQ(got.topk, to_double(reference_topk(p, c))) << case_name(c) << " logits " << logit;
    }
  }
}

// fp64 inputs: out, lse, loss and every gradient within 1e-10 of the fp64 reference (its own selection) at logits
// and indexer scores up to 1e4, on every grid (the latent ring merges its blocks in fp64: attn::lse_merge).
TEST(DsaCpLargeLogits, Fp64MatchesReference) {
  for (double logit : kLargeLogits) {
    const DsaProblem p(48, DType::kFloat64, logit);
    for (const DsaCase& c : large_logit_cases()) {
      const DistResult ref = fp64_reference(p, c, reference_topk(p, c));
      const DistResult got = run_distributed(grid_of(c), c, p);
      const std::string name = str_cat(case_name(c), " logits ", logit);
      EXPECT_EQ(got.topk, ref.topk) << name;
      const double rel = 1e-10;
      EXPECT_TRUE(test::rel_close(got.out, ref.out, rel, name + " out"));
      EXPECT_TRUE(test::rel_close(got.lse, ref.lse, rel, name + " lse"));
      EXPECT_TRUE(test::rel_close(got.dq, ref.dq, rel, name + " dq"));
      EXPECT_TRUE(test::rel_close(got.dc, ref.dc, rel, name + " dc"));
      EXPECT_TRUE(test::rel_close(got.dq_idx, ref.dq_idx, rel, name + " dq_idx"));
      EXPECT_TRUE(test::rel_close(got.dk_idx, ref.dk_idx, rel, name + " dk_idx"));
      EXPECT_TRUE(test::rel_close(got.dw, ref.dw, rel, name + " dw"));
      EXPECT_TRUE(test::rel_close({got.loss}, {ref.loss}, rel, name + " loss"));
      print_errors(str_cat("fp64 ", name, " vs fp64 reference"), errors_of(got, ref));
    }
  }
}

// fp32 inputs: distributed, every output's error against the fp64 reference (on the one-rank selection, which the
// grid reproduces bitwise) is within 2x of the one-rank error, at logits and indexer scores up to 1e4. The floor of
// the one-rank error is fp32's unit roundoff 2^-24. The latent ring's merges keep lse in fp64, so
// they add no rounding of an fp32 lse (eps |lse|, ~6e-4 at logits 1e4, per merge).
TEST(DsaCpLargeLogits, Fp32AndBf16WithinTwiceTheOneRankError) {
  const std::unique_ptr<Communicator> self = world().split(world().rank(), 0);
  const CpGrid one_rank(*self, {1, 1, 1, Placement::kUlyssesInner});
  for (const auto& [dtype, unit_roundoff] : {std::pair{DType::kFloat32, 0x1p-24}, std::pair{DType::kBFloat16, 0x1p-8}})
    for (double logit : kLargeLogits) {
      const DsaProblem p(48, dtype, logit);
      const DsaCase base = large_logit_cases().front();
      const DistResult one = run_distributed(one_rank, base, p);
      const DistResult ref = fp64_reference(p, base, single_rank_topk(p, base.seq, base.topk));
      ASSERT_EQ(one.topk, ref.topk) << "the one-rank run selects what one kernel call selects";
      const std::vector<double> one_err = errors_of(one, ref);
      print_errors(str_cat(dtype_name(dtype), " one rank, logits ", logit, " vs fp64 reference"), one_err);
      for (const DsaCase& c : large_logit_cases()) {
        if (c.topk != base.topk) continue;
        const DistResult got = run_distributed(grid_of(c), c, p);
        const std::string name = str_cat(case_name(c), " logits ", logit);
        ASSERT_EQ(got.topk, one.topk) << name;
        const std::vector<double> err = errors_of(got, ref);
        print_errors(str_cat(dtype_name(dtype), " ", name, " vs fp64 reference"), err);
        for (std::size_t i = 0; i < err.size(); ++i) {
          EXPECT_LE(err[i], 2.0 * std::max(one_err[i], unit_roundoff))
              << dtype_name(dtype) << " " << name << " " << kErrNames[i] << ": distributed error " << err[i]
              << ", one-rank error " << one_err[i];
        }
      }
    }
}

// The window: every selected key is within W - 1 positions of its query, the fp64 kernel selects exactly the fp64
// reference's keys, and the ring selection moves fewer bytes than without a window (only visible index-key rows).
TEST(DsaCp, WindowLimitsCandidates) {
  const std::int64_t window = 7;
  const DsaCase c{1, LayoutKind::kZigzag, DsaSelectMode::kRing, 12, 96, window};
  const DsaProblem p(c.seq);
  const Tensor topk = single_rank_topk(p, c.seq, c.topk, window);
  const std::int64_t* idx = topk.data_as<std::int64_t>();
  for (std::int64_t b = 0; b < kB; ++b) {
    for (std::int64_t t = 0; t < c.seq; ++t) {
      std::int64_t n = 0;
      for (std::int64_t s = 0; s < c.topk; ++s) {
        const std::int64_t j = idx[(b * c.seq + t) * c.topk + s];
        if (j < 0) continue;
        ++n;
        ASSERT_TRUE(j <= t && t - j < window) << "query " << t << " selected key " << j;
      }
      ASSERT_EQ(n, std::min(t + 1, window)) << "query " << t << ": every candidate fits in k = 12";
    }
  }
  const DsaProblem p64(c.seq, DType::kFloat64, 1.0);
  attn::DsaIndexerArgs a{p64.q_idx.view(), p64.w.view(), p64.k_idx.view(), {}, {}, window};
  Tensor got = Tensor::empty({kB, c.seq, c.topk}, DType::kInt64, MemCategory::kWorkspace);
  attn::dsa_indexer_topk(a, got.view());
  EXPECT_EQ(to_double(got), to_double(reference_topk(p64, c)));

  if (world().size() == 1) return;
  auto selection_bytes = [&](std::int64_t w) {
    DsaCpConfig cfg;
    cfg.topk = c.topk;
    cfg.dim_v = kDv;
    cfg.window = w;
    CpGrid grid(world(), test::ring_over_world());
    const CpGroups groups = CpGroups::from(grid);
    DsaCp dsa(groups, SequenceLayout::for_groups(groups, c.seq, c.layout), cfg);
    const auto& pos = dsa.positions();
    Tensor q = piece(p.q, pos), cc = piece(p.c, pos), qi = piece(p.q_idx, pos), ki = piece(p.k_idx, pos),
           w_ = piece(p.w, pos);
    dsa.forward(q.view(), cc.view(), qi.view(), ki.view(), w_.view());
    return dsa.counters().bytes_sent;
  };
  EXPECT_LT(selection_bytes(window), selection_bytes(0));
}

// message_rounds (CpCounters) against its closed form (docs/design.md, "DSA under context parallelism"), P_cp ranks
// in the CP group and P_r in the ring group: forward, the selection's P_cp - 1 in ring mode (none in all-gather mode)
// and the latent ring's P_r - 1; backward, P_r and P_cp (none for a ring of one).
TEST(DsaCp, MessageRoundsOfBothRings) {
  const int n = world().size();
  const std::int64_t seq = 96;
  const DsaProblem p(seq);
  for (int pu : {1, 2}) {
    if (n % pu != 0) continue;
    const int pr = n / pu;
    for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
      DsaCpConfig cfg;
      cfg.select = select;
      cfg.topk = 12;
      cfg.dim_v = kDv;
      CpGrid grid(world(), {1, pu, pr, Placement::kUlyssesInner});
      const CpGroups groups = CpGroups::from(grid);
      DsaCp dsa(groups, SequenceLayout::for_groups(groups, seq, LayoutKind::kZigzag), cfg);
      const auto& pos = dsa.positions();
      Tensor q = piece(p.q, pos), cc = piece(p.c, pos), qi = piece(p.q_idx, pos), ki = piece(p.k_idx, pos),
             w = piece(p.w, pos), dout = piece(p.dout, pos);
      const std::string name = str_cat(dsa_select_mode_name(select), " on ", grid.str());
      DsaCpOutput o = dsa.forward(q.view(), cc.view(), qi.view(), ki.view(), w.view());
      const std::int64_t forward = (select == DsaSelectMode::kRing ? n - 1 : 0) + (pr - 1);
      EXPECT_EQ(dsa.counters().message_rounds, forward) << name << ": forward";
      dsa.backward(std::move(o.ctx), dout.view());
      EXPECT_EQ(dsa.counters().message_rounds, forward + (pr > 1 ? pr : 0) + (n > 1 ? n : 0))
          << name << ": forward and backward";
    }
  }
}

}  // namespace
}  // namespace seqpar
