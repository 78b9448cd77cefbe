// MHA / GQA on packed rows (cu_seqlens) and padded lengths under ring (p2p, all-gather), Ulysses and USP (both
// placements), every layout kind (docs/design.md, "Packed rows and padding"). The independent check: the packed result of document
// d equals document d run alone through the unpacked single-rank path, for every output and gradient; padding rows
// of every local tensor are exactly 0 (lse -inf) and nothing is NaN; bad packings fail on every rank before any
// message.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "parallel/usp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/mha_problem.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::world;

constexpr std::int64_t kHq = 4, kHkv = 2, kDim = 16;

test::MhaShape packed_shape(std::int64_t tokens, attn::MaskSpec mask) {
  return test::one_row_fp64(tokens, kHq, kHkv, kDim, mask);
}

// Padding rows of this rank's local tensors are exactly 0 (lse -inf); no element is NaN.
void expect_clean_padding(const SequenceLayout& layout, int cp_rank, const std::vector<Tensor>& local,
                          const std::string& what) {
  const std::vector<std::int64_t> tok = layout.token_index(cp_rank);
  const std::int64_t rows = layout.local_len();
  bool ok = true;
  for (std::size_t t = 0; t < local.size(); ++t) {
    const std::vector<double> x = test::to_double(local[t].view());
    const bool is_lse = t == 1;  // [1, H, S_local]
    const std::int64_t inner = static_cast<std::int64_t>(x.size()) / rows;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(x.size()); ++i) {
      const std::int64_t row = is_lse ? i % rows : i / inner;
      if (std::isnan(x[i])) ok = false;
      if (tok[row] >= 0) continue;
      if (is_lse ? x[i] != -std::numeric_limits<double>::infinity() : x[i] != 0.0) ok = false;
    }
  }
  EXPECT_TRUE(ok) << what << ": a padding row is not 0 (lse -inf) or a value is NaN";
}

struct MaskCase {
  attn::MaskSpec mask;
  RingImpl impl;
};

std::string mask_name(const MaskCase& m) {
  return str_cat(m.mask.causal ? "causal" : "full", m.mask.window > 0 ? str_cat("_w", m.mask.window) : "", "_",
                 ring_impl_name(m.impl));
}

// Every grid and kind on one packing: the CP result equals the per-document result.
void check_packing(const std::vector<std::int64_t>& lens, const std::vector<MaskCase>& masks,
                   const std::vector<LayoutKind>& kinds) {
  const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
  for (const MaskCase& m : masks) {
    const test::MhaShape s = packed_shape(cu.back(), m.mask);
    const test::MhaProblem p(s);
    const test::MhaResult want = test::per_document_result(s, p, cu);
    for (const CpGridConfig& gc : test::usp_grids(kHq)) {
      const CpGrid grid(world(), gc);
      const CpGroups groups = CpGroups::from(grid);
      for (LayoutKind kind : kinds) {
        const SequenceLayout layout = SequenceLayout::packed_for_groups(groups, cu, kind);
        MhaCpConfig cfg;
        cfg.impl = m.impl;
        cfg.causal = m.mask.causal;
        cfg.window = m.mask.window;
        std::vector<Tensor> local;
        const test::MhaResult got = test::usp_result(grid, s, p, cfg, layout, nullptr, &local);
        const std::string what = str_cat("T=", cu.back(), " docs=", lens.size(), " ", mask_name(m), " u",
                                         gc.ulysses_size, "_", placement_name(gc.placement), " ", layout_name(kind));
        expect_clean_padding(layout, groups.cp_rank(), local, what);
        test::expect_mha_close(got, want, 1e-10, what);
      }
    }
  }
}

const std::vector<MaskCase> kAllMasks = {{{true, 0}, RingImpl::kP2P},
                                         {{false, 0}, RingImpl::kP2P},
                                         {{true, 5}, RingImpl::kP2P},
                                         {{true, 0}, RingImpl::kAllGather},
                                         {{false, 0}, RingImpl::kAllGather}};
const std::vector<LayoutKind> kAllKinds = {LayoutKind::kContiguous, LayoutKind::kZigzag, LayoutKind::kStripe,
                                           LayoutKind::kBalanced};

// An odd total with zero-length documents, documents of length 1, documents shorter than the number of ranks and a
// long one.
TEST(MhaPacked, MixedDocumentsMatchEachDocumentAlone) {
  check_packing({37, 1, 0, 64, 3, 0, 90, 2}, kAllMasks, kAllKinds);
}

TEST(MhaPacked, AllDocumentsOfLengthOne) {
  check_packing(std::vector<std::int64_t>(13, 1), {{{true, 0}, RingImpl::kP2P}, {{false, 0}, RingImpl::kAllGather}},
                kAllKinds);
}

// Fewer tokens than ranks: most ranks hold only padding and still run every exchange.
TEST(MhaPacked, FewerTokensThanRanks) {
  check_packing({1, 2}, {{{true, 0}, RingImpl::kP2P}, {{false, 0}, RingImpl::kP2P}, {{true, 0}, RingImpl::kAllGather}},
                kAllKinds);
}

// One document spanning every rank, packed, equals today's unpacked path bit for bit (no document bound restricts
// anything); an odd unpacked length (197) is padded and equals the single-rank result.
TEST(MhaPacked, OneDocumentEqualsTheUnpackedPath) {
  for (std::int64_t T : {std::int64_t{8} * world().size() * 2, std::int64_t{197}}) {
    for (bool causal : {true, false}) {
      const test::MhaShape s = packed_shape(T, {causal, 0});
      const test::MhaProblem p(s);
      const test::MhaResult single = test::single_rank_result(s, p);
      for (const CpGridConfig& gc : test::usp_grids(kHq)) {
        const CpGrid grid(world(), gc);
        const CpGroups groups = CpGroups::from(grid);
        MhaCpConfig cfg;
        cfg.causal = causal;
        const std::vector<std::int64_t> cu = {0, T};
        const std::string what = str_cat("T=", T, causal ? " causal" : " full", " u", gc.ulysses_size);
        const test::MhaResult packed =
            test::usp_result(grid, s, p, cfg, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kZigzag));
        const test::MhaResult unpacked =
            test::usp_result(grid, s, p, cfg, SequenceLayout::for_groups(groups, T, LayoutKind::kZigzag));
        EXPECT_EQ(packed.out, unpacked.out) << what;
        EXPECT_EQ(packed.dq, unpacked.dq) << what;
        EXPECT_EQ(packed.dk, unpacked.dk) << what;
        EXPECT_EQ(packed.dv, unpacked.dv) << what;
        test::expect_mha_close(unpacked, single, 1e-10, what);
      }
    }
  }
}

// The ring skips the compute of a KV block that shares no document with the local queries (it still travels): with
// one document per ring rank (contiguous, equal lengths) no rank computes any block but its own.
TEST(MhaPacked, RingSkipsBlocksOfOtherDocuments) {
  const int n = world().size();
  const std::int64_t len = 16;
  const std::vector<std::int64_t> cu = cu_seqlens_of(std::vector<std::int64_t>(n, len));
  const test::MhaShape s = packed_shape(cu.back(), {true, 0});
  const test::MhaProblem p(s);
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  MhaCpConfig cfg;
  CpCounters counters;
  test::usp_result(grid, s, p, cfg, SequenceLayout::packed_for_groups(groups, cu, LayoutKind::kContiguous), &counters);
  // FLOPs of the own block only: 4 B Hq D per visible pair forward and 2.5 times that backward, len (len + 1) / 2
  // causal pairs.
  const double own = 4.0 * kHq * kDim * static_cast<double>(len * (len + 1) / 2);
  EXPECT_DOUBLE_EQ(counters.flops, 3.5 * own);
}

// This rank's local out, lse, dq, dk, dv of a USP forward and backward over `layout` on the problem's pieces, with
// `poison` (or nothing when 0) written into every element of every padding row of the local q, k, v and dout.
std::vector<std::vector<double>> local_run(const CpGrid& grid, const SequenceLayout& layout, const test::MhaProblem& p,
                                           const MhaCpConfig& cfg, double poison) {
  const CpGroups groups = CpGroups::from(grid);
  const std::vector<std::int64_t> tok = layout.token_index(groups.cp_rank());
  MhaCp usp(groups, layout, cfg);
  auto piece = [&](const Tensor& full) {
    Tensor t = test::layout_piece(layout, groups.cp_rank(), full);
    if (poison != 0.0) {
      const std::int64_t n = layout.local_len();
      const TensorView rows = t.view().reshape({n, t.numel() / n});
      for (std::int64_t i = 0; i < n; ++i)
        if (tok[static_cast<std::size_t>(i)] < 0) fill(rows.slice0(i, i + 1), poison);
    }
    return t;
  };
  Tensor q = piece(p.q), k = piece(p.k), v = piece(p.v), dout = piece(p.dout);
  MhaCpOutput o = usp.forward(q.view(), k.view(), v.view());
  MhaCpGrads g = usp.backward(std::move(o.ctx), dout.view());
  std::vector<std::vector<double>> r;
  for (const Tensor* t : {&o.out, &o.lse, &g.dq, &g.dk, &g.dv}) r.push_back(test::to_double(t->view()));
  if (g.dsinks.defined()) r.push_back(test::to_double(g.dsinks.view()));
  return r;
}

// NaN and Inf in every padding row of every input (q, k, v, dout) never reach a real token: on every grid, kind and
// implementation, causal, full and a window of 8, fp32 and bf16 (and with sinks), every real row of out, lse, dq, dk,
// dv equals the run with clean (zero) padding rows bit for bit, dsinks too, and padding rows of out, dq, dk, dv are 0
// and of lse -inf. Documents not aligned to 2 ring_size (zigzag pads each), and one of 3 tokens on all ranks.
TEST(MhaPacked, NanAndInfInPaddingRowsNeverReachRealTokens) {
  Tensor sinks = test::random_tensor({kHq}, DType::kFloat32, 5, -1.0, 2.0);
  for (const std::vector<std::int64_t>& lens : {std::vector<std::int64_t>{3}, {37, 51, 40, 57}, {1, 0, 5, 2, 9}}) {
    const std::vector<std::int64_t> cu = cu_seqlens_of(lens);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      test::MhaShape s = packed_shape(cu.back(), {true, 0});
      s.dtype = dtype;
      const test::MhaProblem p(s);
      for (const CpGridConfig& gc : test::usp_grids(kHq, /*both_placements=*/false)) {
        const CpGrid grid(world(), gc);
        const CpGroups groups = CpGroups::from(grid);
        for (LayoutKind kind : kAllKinds) {
          const SequenceLayout layout = SequenceLayout::packed_for_groups(groups, cu, kind);
          const std::vector<std::int64_t> tok = layout.token_index(groups.cp_rank());
          for (const MaskCase& m : {MaskCase{{true, 0}, RingImpl::kP2P}, MaskCase{{false, 0}, RingImpl::kAllGather},
                                    MaskCase{{true, 8}, RingImpl::kP2P}, MaskCase{{false, 0}, RingImpl::kP2P},
                                    MaskCase{{true, 8}, RingImpl::kAllGather}}) {
            for (bool with_sinks : {false, true}) {
              if (with_sinks && dtype != DType::kFloat32) continue;
              MhaCpConfig cfg;
              cfg.impl = m.impl;
              cfg.causal = m.mask.causal;
              cfg.window = m.mask.window;
              if (with_sinks) cfg.score_mods.sinks = sinks;
              const auto clean = local_run(grid, layout, p, cfg, 0.0);
              for (double poison : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                                    -std::numeric_limits<double>::infinity()}) {
                const auto got = local_run(grid, layout, p, cfg, poison);
                const std::string what =
                    str_cat("docs=", lens.size(), " T=", cu.back(), " ", dtype_name(dtype), " ", mask_name(m),
                            with_sinks ? " sinks" : "", " u", gc.ulysses_size, " ", layout_name(kind), " poison ", poison,
                            " rank ", groups.cp_rank());
                const char* names[] = {"out", "lse", "dq", "dk", "dv", "dsinks"};
                ASSERT_EQ(got.size(), clean.size());
                for (std::size_t t = 0; t < got.size(); ++t) {
                  const std::int64_t rows = layout.local_len();
                  const std::int64_t inner = static_cast<std::int64_t>(got[t].size()) / rows;
                  std::int64_t bad = 0, first = -1;
                  for (std::int64_t e = 0; e < static_cast<std::int64_t>(got[t].size()); ++e) {
                    const double g = got[t][e], c = clean[t][e];
                    bool ok;
                    if (t == 5) {  // dsinks [Hq]: every rank's whole vector
                      ok = g == c;
                    } else {
                      const std::int64_t row = t == 1 ? e % rows : e / inner;
                      if (tok[static_cast<std::size_t>(row)] >= 0) {
                        ok = g == c || (std::isnan(g) && std::isnan(c));
                      } else if (t == 1) {
                        ok = g == c && !std::isnan(g);  // -inf, or the sink with sinks
                      } else {
                        ok = g == 0.0;
                      }
                    }
                    if (!ok && bad++ == 0) first = e;
                  }
                  EXPECT_EQ(bad, 0) << what << ": " << names[t] << " differs from the clean run at " << bad
                                    << " elements, first flat index " << first << ": got "
                                    << (first >= 0 ? got[t][first] : 0.0) << ", clean "
                                    << (first >= 0 ? clean[t][first] : 0.0);
                }
              }
            }
          }
        }
      }
    }
  }
}

// Bad packings fail with one clear error on every rank before any message: B > 1, and ranks that disagree on
// cu_seqlens (the agreement check names the digest).
TEST(MhaPacked, BadPackingsFailOnEveryRank) {
  const int n = world().size();
  const CpGrid grid(world(), {1, 1, n});
  const CpGroups groups = CpGroups::from(grid);
  // The error of a forward of USP over `layout` with batch B (empty: none).
  auto forward_error = [&](const SequenceLayout& layout, std::int64_t batch) {
    MhaCp usp(groups, layout, MhaCpConfig{});
    const std::int64_t sl = layout.local_len();
    Tensor q = Tensor::zeros({batch, sl, kHq, kDim}, DType::kFloat32, MemCategory::kWorkspace);
    Tensor k = Tensor::zeros({batch, sl, kHkv, kDim}, DType::kFloat32, MemCategory::kWorkspace);
    try {
      usp.forward(q.view(), k.view(), k.view());
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  test::expect_bad_packings_fail(groups, forward_error);
}

}  // namespace
}  // namespace seqpar
