// GDN and its short conv under context parallelism on packed rows (cu_seqlens) and on padded lengths (any total
// length on any grid): every rank gathers every output and gradient and checks it against the fp64 token-by-token
// reference of the whole packed row (attention/reference/gdn_reference.h, which packs on its own); padding rows of
// every local tensor must be exactly 0 although the inputs there are NaN. Further: each document run alone through
// the unpacked CP path equals its part of the packed result; one document over the whole row equals the unpacked
// path; perturbing one document changes nothing of the others (bitwise); bad input fails on every rank.
// Tolerances: fp32 as tests/mpi/test_gdn_cp.cc (atol 2e-4, rtol 2e-3: chunked fp32 against the fp64 recurrence);
// packed vs alone and one-document vs unpacked: atol 1e-5, rtol 1e-4 (fp32, other chunk boundaries).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "attention/reference/gdn_reference.h"
#include "parallel/gdn_cp.h"
#include "runtime/cp_grid.h"
#include "tests/util/cp_test.h"
#include "tests/util/mpi_test.h"
#include "tests/util/test_util.h"

namespace seqpar {
namespace {

using test::all_close;
using test::to_double;
using test::world;

constexpr std::int64_t kH = 4, kK = 8, kV = 6, kC = 5, kW = 4;  // kH value heads; conv: kC channels, width kW
constexpr MemCategory kWs = MemCategory::kWorkspace;

std::int64_t total(const std::vector<std::int64_t>& lens) {
  return std::accumulate(lens.begin(), lens.end(), std::int64_t{0});
}

std::vector<std::int64_t> cu_of(const std::vector<std::int64_t>& lens) {
  std::vector<std::int64_t> cu{0};
  for (std::int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

Tensor cu_tensor(const std::vector<std::int64_t>& cu) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(cu.size())}, DType::kInt64, kWs);
  std::copy(cu.begin(), cu.end(), t.data_as<std::int64_t>());
  return t;
}

// The full packed row [1, T, ...] (fp32) and the per-document states [N, kH, kK, kV].
struct Row {
  std::vector<std::int64_t> lens;
  std::int64_t hk = 2;
  Tensor q, k, v, g, beta, init, dout, dfinal;
  Row(std::vector<std::int64_t> lens_, std::int64_t hk_, std::uint64_t seed) : lens(std::move(lens_)), hk(hk_) {
    const std::int64_t T = total(lens), N = static_cast<std::int64_t>(lens.size());
    auto make = [&](const Shape& s, std::uint64_t salt, double lo, double hi) {
      return test::random_tensor(s, DType::kFloat32, seed * 16 + salt, lo, hi);
    };
    q = make({1, T, hk, kK}, 1, -1, 1);
    k = make({1, T, hk, kK}, 2, -1, 1);
    v = make({1, T, kH, kV}, 3, -1, 1);
    g = make({1, T, kH}, 4, -0.1, -0.001);  // weak decay: states carry across segments
    beta = make({1, T, kH}, 5, 0.05, 0.5);
    init = make({N, kH, kK, kV}, 6, -0.5, 0.5);
    dout = make({1, T, kH, kV}, 7, -1, 1);
    dfinal = make({N, kH, kK, kV}, 8, -1, 1);
  }
};

// Everything a forward and backward return, as fp64 values of the full row (out, dq, ... by token) and the states,
// in the order of kNames.
using Result = std::vector<std::vector<double>>;
const char* const kNames[] = {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};

void expect_close(const Result& got, const Result& want, double atol, double rtol, const std::string& name) {
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(all_close(got[i], want[i], atol, rtol, name + " " + kNames[i]));
}

Result reference(const Row& r, bool with_init) {
  auto f64 = [](const Tensor& t) { return Tensor::copy_of(t.view(), DType::kFloat64, kWs); };
  const Tensor q = f64(r.q), k = f64(r.k), v = f64(r.v), g = f64(r.g), b = f64(r.beta), i = f64(r.init),
               dout = f64(r.dout), df = f64(r.dfinal), cu = cu_tensor(cu_of(r.lens));
  const attn::GdnForwardArgs a{q, k, v, g, b, with_init ? i.view() : TensorView(), true, 0.0f, 16, cu};
  auto like = [](const Tensor& t) { return Tensor::empty(t.shape(), DType::kFloat64, kWs); };
  Tensor out = like(v), fin = like(i), dq = like(q), dk = like(k), dv = like(v), dg = like(g), db = like(b),
         di = like(i);
  attn::reference::gdn_forward(a, out, fin);
  attn::reference::gdn_backward({a, dout, df}, dq, dk, dv, dg, db, di);
  return {to_double(out), to_double(fin), to_double(dq), to_double(dk),
          to_double(dv),  to_double(dg),  to_double(db), to_double(di)};
}

// This rank's shard of a full [1, T, ...] tensor: row i holds token tokens[i]; padding rows (-1) hold NaN, which the
// layers must never read.
Tensor shard(const Tensor& full, const std::vector<std::int64_t>& tokens) {
  Shape s = full.shape();
  s[1] = static_cast<std::int64_t>(tokens.size());
  Tensor local = Tensor::empty(s, full.dtype(), kWs);
  const std::int64_t row = full.numel() / full.dim(1);
  const float* src = full.data_as<float>();
  float* dst = local.data_as<float>();
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    for (std::int64_t e = 0; e < row; ++e) {
      dst[i * row + e] = tokens[i] < 0 ? std::numeric_limits<float>::quiet_NaN() : src[tokens[i] * row + e];
    }
  }
  return local;
}

// The full [1, T, ...] values from every rank's local rows (fp64 sum over the CP group: each token has one owner).
// Padding rows must be exactly 0: a failure names the tensor.
std::vector<double> gather(Communicator& sp, const Tensor& local, const std::vector<std::int64_t>& tokens,
                           std::int64_t T, const std::string& what) {
  const std::int64_t row = local.numel() / std::max<std::int64_t>(local.dim(1), 1);
  const std::vector<double> x = to_double(local);
  Tensor full = Tensor::zeros({T * row}, DType::kFloat64, kWs);
  double* f = full.data_as<double>();
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    for (std::int64_t e = 0; e < row; ++e) {
      if (tokens[i] >= 0) {
        f[tokens[i] * row + e] = x[i * row + e];
      } else {
        EXPECT_EQ(x[i * row + e], 0.0) << what << ": padding row " << i << " element " << e << " on CP rank "
                                       << sp.rank();
      }
    }
  }
  sp.all_reduce(full.view(), ReduceOp::kSum)->wait();
  return to_double(full);
}

// Copies `n` token rows from row `src_row` and state row `src_state` of `src` to rows `dst_row` / `dst_state` of
// `dst` (every token tensor, initial_state and dfinal_state).
void copy_document(const Row& src, std::int64_t src_row, std::int64_t src_state, std::int64_t n, Row& dst,
                   std::int64_t dst_row, std::int64_t dst_state) {
  auto copy = [](const Tensor& from, const Tensor& to, std::int64_t lo, std::int64_t to_lo, std::int64_t count) {
    const std::int64_t row = from.numel() / (from.dim(0) == 1 ? from.dim(1) : from.dim(0));
    std::copy(from.data_as<float>() + lo * row, from.data_as<float>() + (lo + count) * row,
              to.data_as<float>() + to_lo * row);
  };
  for (auto [from, to] : {std::pair{&src.q, &dst.q},
                          {&src.k, &dst.k},
                          {&src.v, &dst.v},
                          {&src.g, &dst.g},
                          {&src.beta, &dst.beta},
                          {&src.dout, &dst.dout}})
    copy(*from, *to, src_row, dst_row, n);
  copy(src.init, dst.init, src_state, dst_state, 1);
  copy(src.dfinal, dst.dfinal, src_state, dst_state, 1);
}

struct CpRun {
  GdnCpMode mode = GdnCpMode::kScan;
  CpGridConfig grid;
  LayoutKind kind = LayoutKind::kZigzag;
  bool with_init = true;
};

std::string run_name(const CpRun& c, const Row& r) {
  std::string lens;
  for (std::int64_t l : r.lens) lens += str_cat(lens.empty() ? "" : ",", l);
  return str_cat(gdn_cp_mode_name(c.mode), " ", layout_name(c.kind), " Pu ", c.grid.ulysses_size, " Pr ",
                 c.grid.ring_size, c.grid.placement == Placement::kRingInner ? " ring-inner" : "", " Hk ", r.hk,
                 " docs [", lens, "]", c.with_init ? "" : " noinit");
}

// GDN CP on `layout` with the row's tensors; results gathered to the full row on every rank.
Result run_cp(const CpGroups& groups, const SequenceLayout& layout, const CpRun& c, const Row& r,
              const TensorView& init, const TensorView& dfinal) {
  GdnCpConfig cfg;
  cfg.mode = c.mode;
  cfg.chunk_size = 16;
  GdnCp gdn(groups, layout, cfg);
  const std::vector<std::int64_t> tokens = layout.token_index(groups.cp.rank());
  const std::int64_t T = total(r.lens);
  GdnCpOutput o = gdn.forward(shard(r.q, tokens), shard(r.k, tokens), shard(r.v, tokens), shard(r.g, tokens),
                              shard(r.beta, tokens), c.with_init ? init : TensorView());
  GdnCpGrads gr = gdn.backward(std::move(o.ctx), shard(r.dout, tokens), dfinal);
  Communicator& sp = groups.cp;
  return {gather(sp, o.out, tokens, T, "out"),      to_double(o.final_state),
          gather(sp, gr.dq, tokens, T, "dq"),       gather(sp, gr.dk, tokens, T, "dk"),
          gather(sp, gr.dv, tokens, T, "dv"),       gather(sp, gr.dg, tokens, T, "dg"),
          gather(sp, gr.dbeta, tokens, T, "dbeta"), to_double(gr.dinitial_state)};
}

SequenceLayout packed_layout(const CpGrid& grid, LayoutKind kind, const std::vector<std::int64_t>& lens) {
  return SequenceLayout::packed(kind, cu_of(lens), grid.ring().size(), grid.ulysses().size());
}

// Document mixes: mixed lengths with zero-length ones, an odd total; all of length 1; documents shorter than the
// ranks (at 8 ranks some ranks hold padding only); a leading and a trailing empty document; one long and one short.
std::vector<std::vector<std::int64_t>> mixes() {
  return {{37, 1, 0, 50, 3, 0, 17}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {1, 2, 1, 0, 3}, {0, 5, 9, 0}, {120, 1}};
}

// Segments skip padding rows and end at them; pieces cut a segment at document starts (closed forms).
TEST(GdnCpPacked, SegmentsAndPieces) {
  // Rank 0 holds tokens 0 1 2, padding, 3; rank 1 holds padding, 4 5 and token 7; rank 2 holds 6.
  const std::vector<Segment> segs = segments_in_global_order({{0, 1, 2, -1, 3}, {-1, 4, 5, 7}, {6, -1}});
  const std::vector<std::vector<std::int64_t>> want = {
      {0, 3, 0, 0}, {3, 1, 0, 4}, {4, 2, 1, 1}, {6, 1, 2, 0}, {7, 1, 1, 3}};
  ASSERT_EQ(segs.size(), want.size());
  for (std::size_t i = 0; i < segs.size(); ++i) {
    EXPECT_EQ((std::vector<std::int64_t>{segs[i].start, segs[i].length, segs[i].owner, segs[i].local_offset}), want[i])
        << "segment " << i;
  }
  // Documents [0, 2), [2, 2), [2, 5), [5, 9): the segment of tokens 1 .. 6 holds the end of document 0, all of
  // document 2 and the start of document 3 (the empty document 1 has no piece).
  const std::vector<SegmentPiece> pieces = segment_pieces({1, 6, 0, 0}, {0, 2, 2, 5, 9});
  ASSERT_EQ(pieces.size(), 3u);
  const std::vector<std::vector<std::int64_t>> want_pieces = {{0, 1, 0, 0, 1}, {1, 3, 2, 1, 1}, {4, 2, 3, 1, 0}};
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const SegmentPiece& p = pieces[i];
    EXPECT_EQ((std::vector<std::int64_t>{p.offset, p.length, p.doc, p.starts_doc, p.ends_doc}), want_pieces[i])
        << "piece " << i;
  }
}

TEST(GdnCpPacked, MatchesPackedReferenceOnEveryGrid) {
  std::uint64_t seed = 1;
  for (const CpGridConfig& gc : test::usp_grids(kH)) {
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    const bool ring_only = gc.ulysses_size == 1;
    for (const auto& lens : mixes()) {
      for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
        for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
          // USP grids: every mix, scan and zigzag; the ring over the world: every combination.
          if (!ring_only && (mode == GdnCpMode::kChain || kind == LayoutKind::kContiguous)) continue;
          for (const std::int64_t hk : {std::int64_t{2}, std::int64_t{1}}) {
            if (hk == 1 && !ring_only) continue;
            const Row r(lens, hk, ++seed);
            const CpRun c{mode, gc, kind, seed % 3 != 0};
            const Result want = reference(r, c.with_init);
            const Result got = run_cp(groups, packed_layout(grid, kind, lens), c, r, r.init, r.dfinal);
            expect_close(got, want, 2e-4, 2e-3, run_name(c, r));
          }
        }
      }
    }
  }
}

// Any total length on any grid: the unpacked layouts of 197 and 8191 tokens (padded internally), and a packed row of
// 8191 tokens.
TEST(GdnCpPacked, OddTotalsUnpackedAndPacked) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  for (const std::int64_t T : {std::int64_t{197}, std::int64_t{8191}}) {
    const Row r({T}, 2, 40 + T);
    const CpRun c{GdnCpMode::kScan, test::ring_over_world(), LayoutKind::kZigzag, true};
    const Result want = reference(r, true);
    const SequenceLayout unpacked(LayoutKind::kZigzag, T, grid.ring().size(), grid.ulysses().size());
    expect_close(run_cp(groups, unpacked, c, r, r.init, r.dfinal), want, 2e-4, 2e-3, str_cat("unpacked S = ", T));
  }
  const Row r({4000, 1, 0, 4190}, 2, 77);
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    const CpRun c{mode, test::ring_over_world(), LayoutKind::kZigzag, true};
    expect_close(run_cp(groups, packed_layout(grid, c.kind, r.lens), c, r, r.init, r.dfinal), reference(r, true), 2e-4,
                 2e-3, run_name(c, r));
  }
}

// More segments than a tag family spans (4000): 4200 documents of 2 and 1 tokens, zigzag padding each to 2 P slots,
// make 6300 segments, with a state link inside every 2-token document (its two tokens on ring ranks 0 and 1).
TEST(GdnCpPacked, MoreSegmentsThanTags) {
  if (world().size() == 1) GTEST_SKIP() << "one rank holds the row as one segment";
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  std::vector<std::int64_t> lens;
  for (int i = 0; i < 2100; ++i) lens.insert(lens.end(), {2, 1});
  const Row r(lens, 2, 123);
  const Result want = reference(r, true);
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    const CpRun c{mode, test::ring_over_world(), LayoutKind::kZigzag, true};
    expect_close(run_cp(groups, packed_layout(grid, c.kind, lens), c, r, r.init, r.dfinal), want, 2e-4, 2e-3,
                 str_cat(gdn_cp_mode_name(mode), " 4200 documents"));
  }
}

// Each document alone through the unpacked CP path (its own layout, its initial state as a batch of one) equals its
// part of the packed result; one document over the whole row equals the unpacked path of the same row.
TEST(GdnCpPacked, EveryDocumentEqualsItselfAloneUnpacked) {
  const CpGridConfig gc = test::small_grid_config();
  const CpGrid grid(world(), gc);
  const CpGroups groups = CpGroups::from(grid);
  const Row r({37, 1, 0, 50, 3, 17}, 2, 91);
  const CpRun c{GdnCpMode::kScan, gc, LayoutKind::kZigzag, true};
  const Result packed = run_cp(groups, packed_layout(grid, c.kind, r.lens), c, r, r.init, r.dfinal);
  const std::int64_t state = kH * kK * kV;
  std::int64_t begin = 0;
  for (std::size_t d = 0; d < r.lens.size(); ++d) {
    const std::int64_t len = r.lens[d], end = begin + len;
    if (len == 0) continue;
    // Document d as its own row: the same values, seed-independent copies of the packed row's rows.
    Row one({len}, r.hk, 0);
    copy_document(r, begin, static_cast<std::int64_t>(d), len, one, 0, 0);
    const SequenceLayout lay(c.kind, len, grid.ring().size(), grid.ulysses().size());
    const Result alone = run_cp(groups, lay, c, one, one.init, one.dfinal);
    auto part = [](const std::vector<double>& v, std::int64_t lo, std::int64_t hi, std::int64_t per) {
      return std::vector<double>(v.begin() + lo * per, v.begin() + hi * per);
    };
    // Rows of document d per result (tokens, or its state row), and the elements per row.
    const std::int64_t lo[] = {begin, static_cast<std::int64_t>(d), begin, begin, begin, begin,
                               begin, static_cast<std::int64_t>(d)};
    const std::int64_t per[] = {kH * kV, state, r.hk * kK, r.hk * kK, kH * kV, kH, kH, state};
    Result want;
    for (std::size_t i = 0; i < packed.size(); ++i) {
      const std::int64_t hi = lo[i] + (per[i] == state ? 1 : len);
      want.push_back(part(packed[i], lo[i], hi, per[i]));
    }
    expect_close(alone, want, 1e-5, 1e-4, str_cat("document ", d, " alone vs packed"));
    begin = end;
  }
  // One document spanning the row: packed = unpacked.
  const Row whole({150}, 2, 92);
  const Result p1 = run_cp(groups, packed_layout(grid, c.kind, whole.lens), c, whole, whole.init, whole.dfinal);
  const SequenceLayout unpacked(c.kind, 150, grid.ring().size(), grid.ulysses().size());
  expect_close(p1, run_cp(groups, unpacked, c, whole, whole.init, whole.dfinal), 1e-5, 1e-4, "one document");
}

// Perturbing every input of document 1 (its tokens, initial state, dout and dfinal_state) changes nothing of
// documents 0 and 2, bitwise, in chain and scan: no state leaks forward, no gradient backward.
TEST(GdnCpPacked, NoLeaksBetweenDocuments) {
  const CpGridConfig gc = test::small_grid_config();
  const CpGrid grid(world(), gc);
  const CpGroups groups = CpGroups::from(grid);
  const std::vector<std::int64_t> lens{29, 31, 27};
  for (GdnCpMode mode : {GdnCpMode::kChain, GdnCpMode::kScan}) {
    const CpRun c{mode, gc, LayoutKind::kZigzag, true};
    const SequenceLayout lay = packed_layout(grid, c.kind, lens);
    const Row base(lens, 2, 5), other(lens, 2, 6);
    const Result a = run_cp(groups, lay, c, base, base.init, base.dfinal);
    Row pert(lens, 2, 5);
    copy_document(other, lens[0], 1, lens[1], pert, lens[0], 1);
    const Result b = run_cp(groups, lay, c, pert, pert.init, pert.dfinal);
    // Elements of document 1: token rows [29, 60) or state row 1; everything else must be identical.
    auto check = [&](const std::vector<double>& x, const std::vector<double>& y, std::int64_t per_unit, std::int64_t lo,
                     std::int64_t hi, const char* what) {
      bool inside_changed = false;
      for (std::size_t e = 0; e < x.size(); ++e) {
        const auto unit = static_cast<std::int64_t>(e) / per_unit;
        if (unit >= lo && unit < hi) {
          inside_changed |= x[e] != y[e];
        } else if (x[e] != y[e]) {
          ADD_FAILURE() << gdn_cp_mode_name(mode) << " " << what << " element " << e
                        << " outside document 1 changed: " << x[e] << " -> " << y[e];
          return;
        }
      }
      EXPECT_TRUE(inside_changed) << what << ": the perturbation did not reach document 1";
    };
    const std::int64_t st = kH * kK * kV;
    const std::int64_t per[] = {kH * kV, st, 2 * kK, 2 * kK, kH * kV, kH, kH, st};
    for (std::size_t i = 0; i < a.size(); ++i) {
      const bool state = per[i] == st;
      check(a[i], b[i], per[i], state ? 1 : lens[0], state ? 2 : lens[0] + lens[1], kNames[i]);
    }
  }
}

// Bad input on a packed layout fails on every rank with the rule, before anything is sent.
TEST(GdnCpPacked, BadInputFailsOnEveryRank) {
  const CpGrid grid(world(), test::ring_over_world());
  const CpGroups groups = CpGroups::from(grid);
  const SequenceLayout lay = packed_layout(grid, LayoutKind::kZigzag, {5, 7});
  GdnCp gdn(groups, lay, GdnCpConfig{});
  const std::int64_t sl = lay.local_len();
  // Zero q (= k), v and g (= beta) of `batch` rows and `rows` tokens, and a forward of `layer` on them.
  struct Inputs {
    Tensor q, v, g;
    Inputs(std::int64_t batch, std::int64_t rows)
        : q(Tensor::zeros({batch, rows, 2, kK}, DType::kFloat32, kWs)),
          v(Tensor::zeros({batch, rows, kH, kV}, DType::kFloat32, kWs)),
          g(Tensor::zeros({batch, rows, kH}, DType::kFloat32, kWs)) {}
    void forward(GdnCp& layer, const TensorView& init = {}) const { layer.forward(q, q, v, g, g, init); }
  };
  test::expect_error([&] { Inputs(2, sl).forward(gdn); }, "needs batch size 1, got B = 2");
  Tensor init1 = Tensor::zeros({1, kH, kK, kV}, DType::kFloat32, kWs);  // 2 documents need [2, H, K, V]
  test::expect_error([&] { Inputs(1, sl).forward(gdn, init1); }, "initial_state");
  if (world().size() > 1) {
    // Ranks handed different packings of the same 12 tokens: the named agreement error on every rank.
    const SequenceLayout other =
        packed_layout(grid, LayoutKind::kZigzag,
                      world().rank() == 0 ? std::vector<std::int64_t>{5, 7} : std::vector<std::int64_t>{6, 6});
    GdnCp g(groups, other, GdnCpConfig{});
    test::expect_error([&] { Inputs(1, other.local_len()).forward(g); }, "disagree on");
  }
  ShortConvCp conv(groups, lay);
  Tensor x2 = Tensor::zeros({2, sl, kC}, DType::kFloat32, kWs), w = Tensor::zeros({kC, kW}, DType::kFloat32, kWs);
  test::expect_error([&] { conv.forward(x2, w); }, "needs batch size 1, got B = 2");
}

// The short conv on packed rows: no output reads another document's input (the halo stops at the document start);
// out, dx and dweight against the fp64 direct conv of the packed row.
TEST(ShortConvCpPacked, MatchesPackedReference) {
  for (const CpGridConfig& gc : test::usp_grids(kH)) {
    const CpGrid grid(world(), gc);
    const CpGroups groups = CpGroups::from(grid);
    for (const auto& lens : mixes()) {
      for (LayoutKind kind : {LayoutKind::kContiguous, LayoutKind::kZigzag}) {
        const std::int64_t T = total(lens);
        const Tensor x = test::random_tensor({1, T, kC}, DType::kFloat32, 301 + T),
                     w = test::random_tensor({kC, kW}, DType::kFloat32, 302),
                     dy = test::random_tensor({1, T, kC}, DType::kFloat32, 303 + T);
        const Tensor x64 = Tensor::copy_of(x, DType::kFloat64, kWs), w64 = Tensor::copy_of(w, DType::kFloat64, kWs),
                     dy64 = Tensor::copy_of(dy, DType::kFloat64, kWs), cu = cu_tensor(cu_of(lens));
        attn::ShortConvArgs ra;
        ra.x = x64;
        ra.weight = w64;
        ra.cu_seqlens = cu;
        Tensor y_ref = Tensor::empty(x.shape(), DType::kFloat64, kWs),
               dx_ref = Tensor::empty(x.shape(), DType::kFloat64, kWs),
               dw_ref = Tensor::empty(w.shape(), DType::kFloat64, kWs);
        attn::reference::short_conv_forward(ra, y_ref, {});
        attn::reference::short_conv_backward(ra, dy64, dx_ref, dw_ref, {});

        const SequenceLayout lay = packed_layout(grid, kind, lens);
        ShortConvCp conv(groups, lay);
        const std::vector<std::int64_t> tokens = lay.token_index(groups.cp.rank());
        ShortConvCpOutput o = conv.forward(shard(x, tokens), w);
        Tensor dw = Tensor::empty(w.shape(), DType::kFloat32, kWs);
        const Tensor dx = conv.backward(std::move(o.ctx), shard(dy, tokens), dw);
        std::string name = str_cat("short conv ", layout_name(kind), " Pu ", gc.ulysses_size, " T ", T);
        EXPECT_TRUE(all_close(gather(groups.cp, o.out, tokens, T, "out"), to_double(y_ref), 1e-5, 1e-5, name + " out"));
        EXPECT_TRUE(all_close(gather(groups.cp, dx, tokens, T, "dx"), to_double(dx_ref), 1e-5, 1e-5, name + " dx"));
        EXPECT_TRUE(all_close(to_double(dw), to_double(dw_ref), 1e-4, 1e-5, name + " dweight"));
      }
    }
  }
}

}  // namespace
}  // namespace seqpar
