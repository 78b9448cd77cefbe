// DSA under context parallelism on packed rows (cu_seqlens) and padded lengths (docs/design.md, "DSA on packed rows"): ring
// and all-gather selection, the latent ring, USP grids, every layout kind. The independent check: document d of the
// packed result equals document d run alone through the unpacked single-device kernels (topk_indices mapped to the
// document's tokens, out, lse, the indexer loss summed over documents, every gradient); padding rows of every local
// tensor are 0 (lse -inf, topk -1) and nothing is NaN; bad packings fail on every rank before any message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "parallel/dsa_cp.h"
#include "parallel/ring_pass.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/dsa_packed.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;
using test::dsa_packed::Di;
using test::dsa_packed::Dqk;
using test::dsa_packed::Dv;
using test::dsa_packed::H;
using test::dsa_packed::Hi;
using test::dsa_packed::Inputs;
using test::dsa_packed::Result;

using test::layout_piece;
std::vector<double> gathered(Communicator& sp, const SequenceLayout& layout, const Tensor& local, Shape full,
                             int seq_dim = 1) {
  full[static_cast<std::size_t>(seq_dim)] = layout.seq_len();
  Tensor t = Tensor::empty(full, local.dtype(), MemCategory::kWorkspace);
  gather_sequence(sp, layout, local.view(), t.view(), seq_dim);
  return test::to_double(t.view());
}

// Padding rows of this rank's local tensors are 0 (lse -inf, topk -1); no value is NaN.
void expect_clean_padding(const SequenceLayout& layout, int cp_rank, const DsaCpOutput& o, const DsaCpGrads& g,
                          const std::string& what) {
  const std::vector<std::int64_t> tok = layout.token_index(cp_rank);
  const std::int64_t rows = layout.local_len();
  bool ok = true;
  const auto check = [&](const Tensor& t, bool is_lse, double pad_value) {
    const std::vector<double> x = test::to_double(t.view());
    const std::int64_t inner = static_cast<std::int64_t>(x.size()) / rows;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(x.size()); ++i) {
      const std::int64_t row = is_lse ? i % rows : i / inner;
      if (std::isnan(x[static_cast<std::size_t>(i)])) ok = false;
      if (tok[static_cast<std::size_t>(row)] < 0 && x[static_cast<std::size_t>(i)] != pad_value) ok = false;
    }
  };
  check(o.out, false, 0.0);
  check(o.lse, true, -std::numeric_limits<double>::infinity());
  check(o.topk_indices, false, -1.0);
  for (const Tensor* t : {&g.dq, &g.dc, &g.dq_idx, &g.dk_idx, &g.dw}) check(*t, false, 0.0);
  EXPECT_TRUE(ok) << what << ": a padding row is not 0 (lse -inf, topk -1) or a value is NaN";
}

// The whole packed row on one grid and layout: every output gathered to token space, topk mapped to tokens.
Result run_cp(const CpGrid& grid, const SequenceLayout& layout, const DsaCpConfig& cfg, const Inputs& in,
              const std::string& what) {
  const CpGroups groups = CpGroups::from(grid);
  DsaCp dsa(groups, layout, cfg);
  const int r = groups.cp_rank();
  Tensor q = layout_piece(layout, r, in.q), c = layout_piece(layout, r, in.c), qi = layout_piece(layout, r, in.q_idx),
         ki = layout_piece(layout, r, in.k_idx), w = layout_piece(layout, r, in.w),
         dout = layout_piece(layout, r, in.dout);
  DsaCpOutput o = dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view());
  DsaCpGrads g = dsa.backward(std::move(o.ctx), dout.view());
  expect_clean_padding(layout, r, o, g, what);
  Communicator& sp = grid.cp();
  Result res;
  dsa_topk_slots_to_tokens(layout, o.topk_indices.view());  // before the gather
  for (double x : gathered(sp, layout, o.topk_indices, o.topk_indices.shape()))
    res.topk.push_back(static_cast<std::int64_t>(x));
  res.out = gathered(sp, layout, o.out, o.out.shape());
  res.lse = gathered(sp, layout, o.lse, o.lse.shape(), 2);
  res.dq = gathered(sp, layout, g.dq, g.dq.shape());
  res.dc = gathered(sp, layout, g.dc, g.dc.shape());
  res.dq_idx = gathered(sp, layout, g.dq_idx, g.dq_idx.shape());
  res.dw = gathered(sp, layout, g.dw, g.dw.shape());
  res.dk_idx = gathered(sp, layout, g.dk_idx, g.dk_idx.shape());
  res.loss = g.loss;
  return res;
}

// Document by document on one device (no bounds), assembled in token space; topk shifted to the document's tokens.
Result per_document(const Inputs& in, const std::vector<std::int64_t>& cu, std::int64_t K, std::int64_t window = 0) {
  const std::int64_t T = cu.back();
  Result all;
  all.lse.assign(static_cast<std::size_t>(H * T), 0.0);
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const std::int64_t start = cu[d], n = cu[d + 1] - cu[d];
    if (n == 0) continue;
    Inputs alone_in = in.rows(start, n);
    const Result a = test::dsa_packed::run(alone_in, K, {}, {}, false, window);
    for (std::int64_t x : a.topk) all.topk.push_back(x < 0 ? -1 : x + start);
    for (auto [dst, src] :
         {std::pair{&all.out, &a.out}, std::pair{&all.dq, &a.dq}, std::pair{&all.dc, &a.dc},
          std::pair{&all.dq_idx, &a.dq_idx}, std::pair{&all.dw, &a.dw}, std::pair{&all.dk_idx, &a.dk_idx}}) {
      dst->insert(dst->end(), src->begin(), src->end());
    }
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t i = 0; i < n; ++i) all.lse[static_cast<std::size_t>(h * T + start + i)] = a.lse[h * n + i];
    }
    all.loss += a.loss;
  }
  return all;
}

void expect_match(const Result& got, const Result& want, const std::string& what) {
  EXPECT_EQ(got.topk, want.topk) << what << ": topk_indices differ from the documents' own selections";
  const double tol = 1e-10;
  EXPECT_TRUE(test::all_close(got.out, want.out, tol, tol, what + " out"));
  EXPECT_TRUE(test::all_close(got.lse, want.lse, tol, tol, what + " lse"));
  EXPECT_TRUE(test::all_close(got.dq, want.dq, tol, tol, what + " dq"));
  EXPECT_TRUE(test::all_close(got.dc, want.dc, tol, tol, what + " dc"));
  EXPECT_TRUE(test::all_close(got.dq_idx, want.dq_idx, tol, tol, what + " dq_idx"));
  EXPECT_TRUE(test::all_close(got.dw, want.dw, tol, tol, what + " dw"));
  EXPECT_TRUE(test::all_close(got.dk_idx, want.dk_idx, tol, tol, what + " dk_idx"));
  EXPECT_NEAR(got.loss, want.loss, tol * (1.0 + std::abs(want.loss))) << what << " loss";
}

const std::vector<LayoutKind> kAllKinds = {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                           LayoutKind::kBalanced};

// Every USP grid, kind and selection mode on one packing (fp64 inputs): the CP result equals the per-document one.
void check_packing(const std::vector<std::int64_t>& lens, std::int64_t K, std::uint64_t seed,
                   const std::vector<LayoutKind>& kinds = kAllKinds, std::int64_t window = 0) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
  const Inputs in(cu.back(), DType::kFloat64, seed);
  const Result want = per_document(in, cu, K, window);
  for (const CpGridConfig& gc : test::usp_grids(H)) {
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    for (LayoutKind kind : kinds) {
      for (DsaSelectMode select : {DsaSelectMode::kRing, DsaSelectMode::kAllGather}) {
        DsaCpConfig cfg;
        cfg.select = select;
        cfg.topk = K;
        cfg.dim_v = Dv;
        cfg.window = window;
        const std::string what = str_cat("T=", cu.back(), " docs=", lens.size(), " k=", K, " W=", window, " ",
                                         grid.str(), " ", layout_name(kind), " ", dsa_select_mode_name(select));
        expect_match(run_cp(grid, SequenceLayout::packed_for_groups(groups, cu, kind), cfg, in, what), want, what);
      }
    }
  }
}

// An odd total with zero-length documents, documents of length 1, documents shorter than k and than the number of
// ranks, and a long one.
TEST(DsaPacked, MixedDocumentsMatchEachDocumentAlone) { check_packing({37, 1, 0, 64, 3, 0, 90, 2}, 8, 11); }

// The indexer's sliding window counts inside each document (ring selection moves only the rows a window can see).
TEST(DsaPacked, WindowInsideDocuments) {
  check_packing({37, 1, 0, 64, 3, 0, 90, 2}, 8, 16, {LayoutKind::kZigzag, LayoutKind::kBalanced}, 6);
}

// With a window the selection's plan moves only index-key rows that a query of their own document sees. The plan
// against a brute-force scan of every (query, key) pair with the layout's documents; and the layer's bytes: the
// same row packed (contiguous kind: the same slots and shards as one unpacked document of T tokens) sends exactly
// the rows the plan drops fewer index-key rows than the unpacked row, and the result still equals each document alone.
TEST(DsaPacked, WindowPlanSendsOnlyRowsOfTheQueriesDocuments) {
  // Documents of 10 tokens (and a zero-length one, one of length 1): every shard boundary falls within the window of
  // other documents' keys, which the unpacked row sends and the packed one does not.
  std::vector<std::int64_t> lens(9, 10);
  lens.insert(lens.end(), {0, 1});
  lens.insert(lens.end(), 10, 10);
  lens.push_back(6);
  const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
  const std::int64_t T = cu.back(), W = 40, K = 8;
  const int n = world().size(), r = world().rank();
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kBalanced}) {
    const SequenceLayout packed = SequenceLayout::packed_for_groups(groups, cu, kind);
    std::vector<std::vector<std::int64_t>> pos;
    for (int x = 0; x < n; ++x) pos.push_back(packed.positions(x));
    const WindowPlan plan(pos, r, W, window_doc_bounds(packed, pos));
    for (int d = 1; d < n; ++d) {  // the rows of rank r - d this rank receives, pair by pair
      const int src = (r - d + n) % n;
      std::vector<std::int64_t> want;
      for (std::size_t j = 0; j < pos[src].size(); ++j) {
        const std::int64_t k = pos[src][j], kd = packed.doc_of_slot(k);
        bool seen = false;
        for (const std::int64_t q : pos[r])
          seen = seen || (kd >= 0 && packed.doc_of_slot(q) == kd && q >= k && q - k < W);
        if (seen) want.push_back(static_cast<std::int64_t>(j));
      }
      const auto got = plan.recv_rows(d);
      EXPECT_EQ(std::vector<std::int64_t>(got.begin(), got.end()), want) << layout_name(kind) << " d " << d;
    }
  }
  // The layer's bytes: packed against one unpacked document of the same T (contiguous: identical shards).
  const Inputs in(T, DType::kFloat64, 21);
  const Result want = per_document(in, cu, K, W);
  DsaCpConfig cfg;
  cfg.select = DsaSelectMode::kRing;
  cfg.topk = K;
  cfg.dim_v = Dv;
  cfg.window = W;
  std::int64_t bytes[2] = {0, 0}, rows[2] = {0, 0};
  for (int packed_row = 0; packed_row < 2; ++packed_row) {
    const std::vector<std::int64_t> one_doc = {0, T};
    const SequenceLayout layout =
        SequenceLayout::packed_for_groups(groups, packed_row ? cu : one_doc, LayoutKind::kContiguous);
    std::vector<std::vector<std::int64_t>> pos;
    for (int x = 0; x < n; ++x) pos.push_back(layout.positions(x));
    rows[packed_row] = WindowPlan(pos, r, W, window_doc_bounds(layout, pos)).rows_sent();
    DsaCp dsa(groups, layout, cfg);
    Tensor q = layout_piece(layout, r, in.q), c = layout_piece(layout, r, in.c), qi = layout_piece(layout, r, in.q_idx),
           ki = layout_piece(layout, r, in.k_idx), w = layout_piece(layout, r, in.w);
    DsaCpOutput o = dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view());
    bytes[packed_row] = dsa.counters().bytes_sent;
    if (!packed_row) continue;
    Tensor dout = layout_piece(layout, r, in.dout);
    dsa.backward(std::move(o.ctx), dout.view());
  }
  EXPECT_EQ(bytes[0] - bytes[1], (rows[0] - rows[1]) * Di * 8) << "index-key bytes saved by the document bounds";
  if (r + 1 < n) {
    EXPECT_LT(rows[1], rows[0]) << "the packed row must send fewer index-key rows";
  }
  expect_match(run_cp(grid, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kContiguous), cfg, in,
                      "window plan, contiguous"),
               want, "window plan, contiguous");
}

TEST(DsaPacked, AllDocumentsOfLengthOne) {
  check_packing(std::vector<std::int64_t>(13, 1), 4, 12, {LayoutKind::kZigzag, LayoutKind::kBalanced});
}

// Fewer tokens than ranks: most ranks hold only padding and still run every exchange.
TEST(DsaPacked, FewerTokensThanRanks) { check_packing({1, 2}, 4, 13); }

// One document spanning every rank (T = 197, odd), packed and unpacked (padded), equals the single-device result.
TEST(DsaPacked, OneDocumentEqualsTheUnpackedPath) {
  const std::int64_t T = 197, K = 16;
  const std::vector<std::int64_t> cu = {0, T};
  const Inputs in(T, DType::kFloat64, 14);
  const Result want = per_document(in, cu, K);
  for (const CpGridConfig& gc : test::usp_grids(H, false)) {
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    DsaCpConfig cfg;
    cfg.topk = K;
    cfg.dim_v = Dv;
    const std::string what = str_cat("T=", T, " ", grid.str());
    expect_match(run_cp(grid, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag), cfg, in, what), want,
                 what + " packed");
    expect_match(run_cp(grid, SequenceLayout::for_groups(groups, T, LayoutKind::kZigzag), cfg, in, what), want,
                 what + " unpacked");
  }
}

// A larger odd total on the ring (1001 tokens in documents of mixed lengths, k = 64).
TEST(DsaPacked, LargerOddTotal) { check_packing({400, 7, 0, 333, 1, 260}, 64, 15, {LayoutKind::kBalanced}); }

// The odd total, S = 8191, on the two packed kinds: documents of at most 300 tokens (with zero-length ones and
// ones of length 1) keep the per-document reference and the selection cheap, while the row still spans every rank and
// every rank's shard holds pieces of many documents.
TEST(DsaPacked, OddTotal8191) {
  std::vector<std::int64_t> lens;
  const std::vector<std::int64_t> pattern = {300, 1, 0, 129, 77, 256, 3, 190};
  std::int64_t total = 0;
  for (std::size_t i = 0; total < 8191; ++i) {
    const std::int64_t n = std::min(pattern[i % pattern.size()], 8191 - total);
    lens.push_back(n);
    total += n;
  }
  check_packing(lens, 16, 17, {LayoutKind::kZigzag, LayoutKind::kBalanced});
}

// Bad packings fail with one clear error on every rank before any message: B > 1, bad cu_seqlens, and ranks that
// disagree on cu_seqlens (the agreement check names the digest).
TEST(DsaPacked, BadPackingsFailOnEveryRank) {
  const int n = world().size();
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  auto forward_error = [&](const SequenceLayout& layout, std::int64_t batch) {
    DsaCpConfig cfg;
    cfg.topk = 4;
    cfg.dim_v = Dv;
    DsaCp dsa(groups, layout, cfg);
    const std::int64_t sl = layout.local_len();
    Tensor q = Tensor::zeros({batch, sl, H, Dqk}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor c = Tensor::zeros({batch, sl, Dqk}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor qi = Tensor::zeros({batch, sl, Hi, Di}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor ki = Tensor::zeros({batch, sl, Di}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor w = Tensor::zeros({batch, sl, Hi}, DType::kFloat32, MemCategory::kWorkspace);
    try {
      dsa.forward(q.view(), c.view(), qi.view(), ki.view(), w.view());
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  test::expect_bad_packings_fail(groups, forward_error);
  // cu_seqlens that do not start at 0, decrease or hold a negative value fail in the layout, on every rank alike
  for (const std::vector<std::int64_t>& bad :
       {std::vector<std::int64_t>{1, 5, 12}, std::vector<std::int64_t>{0, 7, 5}, std::vector<std::int64_t>{0, -1, 5}}) {
    test::expect_error([&] { (void)SequenceLayout::packed_for_groups(groups, bad, LayoutKind::kZigzag); },
                       "cu_seqlens");
  }
}

}  // namespace
}  // namespace seqpar
