#include "tests/util/mha_problem.h"

#include <limits>
#include <numeric>

#include "attention/reference/mha_reference.h"
#include "tests/util/cp_test.h"
#include "tests/util/test_util.h"

namespace seqpar::test {

MhaProblem::MhaProblem(const MhaShape& s)
    : q(random_tensor({s.batch, s.seq, s.hq, s.dim}, s.dtype, 11 + s.seed)),
      k(random_tensor({s.batch, s.seq, s.hkv, s.dim}, s.dtype, 12 + s.seed)),
      v(random_tensor({s.batch, s.seq, s.hkv, s.dim}, s.dtype, 13 + s.seed)),
      dout(random_tensor({s.batch, s.seq, s.hq, s.dim}, s.dtype, 14 + s.seed)) {
  if (s.logits > 0) set_logit_offset(q.view(), k.view(), s.logits);
}

MhaResult single_rank_result(const MhaShape& s, const MhaProblem& p) {
  attn::MhaForwardArgs args;
  args.q = p.q.view();
  args.k = p.k.view();
  args.v = p.v.view();
  args.mask = s.mask;
  args.mods = s.mods;
  args.dropout = s.dropout;
  Tensor out = Tensor::empty(p.q.shape(), s.dtype, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({s.batch, s.hq, s.seq}, accumulator_dtype(s.dtype), MemCategory::kWorkspace);
  attn::mha_forward(args, out.view(), lse.view());
  attn::MhaBackwardArgs bargs;
  bargs.fwd = args;
  bargs.out = out.view();
  bargs.dout = p.dout.view();
  bargs.lse = lse.view();
  Tensor dq = Tensor::empty(p.q.shape(), s.dtype, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(p.k.shape(), s.dtype, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(p.v.shape(), s.dtype, MemCategory::kWorkspace);
  attn::mha_backward(bargs, dq.view(), dk.view(), dv.view(), false);
  MhaResult r{to_double(out), to_double(lse), to_double(dq), to_double(dk), to_double(dv), {}};
  if (!s.mods.sinks.empty()) {
    Tensor delta = Tensor::empty(lse.shape(), lse.dtype(), MemCategory::kWorkspace);
    Tensor dsinks = Tensor::empty(s.mods.sinks.shape(), s.mods.sinks.dtype(), MemCategory::kWorkspace);
    attn::mha_backward_delta(out.view(), p.dout.view(), delta.view());
    attn::mha_sinks_backward({delta.view(), lse.view(), s.mods.sinks}, dsinks.view());
    r.dsinks = to_double(dsinks);
  }
  return r;
}

MhaResult reference_result(const MhaShape& s, const MhaProblem& p) {
  auto f64 = [](const Tensor& t) { return Tensor::copy_of(t.view(), DType::kFloat64, MemCategory::kWorkspace); };
  Tensor q = f64(p.q), k = f64(p.k), v = f64(p.v), dout = f64(p.dout);
  attn::MhaForwardArgs args;
  args.q = q.view();
  args.k = k.view();
  args.v = v.view();
  args.mask = s.mask;
  args.mods = s.mods;
  args.dropout = s.dropout;
  Tensor out = Tensor::empty(q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor lse = Tensor::empty({s.batch, s.hq, s.seq}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor dq = Tensor::empty(q.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(k.shape(), DType::kFloat64, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::mha_forward(args, out.view(), lse.view());
  Tensor dsinks;
  if (!s.mods.sinks.empty()) dsinks = Tensor::empty({s.hq}, DType::kFloat64, MemCategory::kWorkspace);
  attn::reference::mha_backward(args, dout.view(), dq.view(), dk.view(), dv.view(), dsinks.view());
  return {to_double(out), to_double(lse), to_double(dq),
          to_double(dk),  to_double(dv),  s.mods.sinks.empty() ? std::vector<double>{} : to_double(dsinks)};
}

MhaResult per_document_result(const MhaShape& s, const MhaProblem& p, const std::vector<std::int64_t>& cu) {
  const std::int64_t T = s.seq;
  MhaResult want;
  want.out.assign(static_cast<std::size_t>(T * s.hq * s.dim), 0.0);
  want.dq = want.out;
  want.dk.assign(static_cast<std::size_t>(T * s.hkv * s.dim), 0.0);
  want.dv = want.dk;
  want.lse.assign(static_cast<std::size_t>(s.hq * T), -std::numeric_limits<double>::infinity());
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    const std::int64_t a = cu[d], len = cu[d + 1] - cu[d];
    if (len == 0) continue;
    std::vector<std::int64_t> rows(static_cast<std::size_t>(len));
    std::iota(rows.begin(), rows.end(), a);
    MhaShape sub = s;
    sub.seq = len;
    MhaProblem doc;
    doc.q = local_piece(p.q.view(), rows);
    doc.k = local_piece(p.k.view(), rows);
    doc.v = local_piece(p.v.view(), rows);
    doc.dout = local_piece(p.dout.view(), rows);
    const MhaResult r = single_rank_result(sub, doc);
    auto place_rows = [&](const std::vector<double>& from, std::vector<double>& to, std::int64_t row) {
      std::copy(from.begin(), from.end(), to.begin() + a * row);
    };
    place_rows(r.out, want.out, s.hq * s.dim);
    place_rows(r.dq, want.dq, s.hq * s.dim);
    place_rows(r.dk, want.dk, s.hkv * s.dim);
    place_rows(r.dv, want.dv, s.hkv * s.dim);
    for (std::int64_t h = 0; h < s.hq; ++h) {
      for (std::int64_t i = 0; i < len; ++i) want.lse[h * T + a + i] = r.lse[h * len + i];
    }
  }
  return want;
}

DocBounds token_doc_bounds(const std::vector<std::int64_t>& cu) {
  DocBounds b;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d) {
    for (std::int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      b.lo.push_back(cu[d]);
      b.hi.push_back(cu[d + 1]);
    }
  }
  return b;
}

MhaShape one_row_fp64(std::int64_t tokens, std::int64_t hq, std::int64_t hkv, std::int64_t dim, attn::MaskSpec mask) {
  MhaShape s;
  s.batch = 1;
  s.seq = tokens;
  s.hq = hq;
  s.hkv = hkv;
  s.dim = dim;
  s.dtype = DType::kFloat64;
  s.mask = mask;
  return s;
}

MhaCpConfig cp_config(const MhaShape& s, RingImpl impl) {
  MhaCpConfig cfg;
  cfg.impl = impl;
  cfg.causal = s.mask.causal;
  cfg.window = s.mask.window;
  cfg.score_mods = s.mods;
  cfg.dropout = s.dropout;
  return cfg;
}

Tensor local_piece(const TensorView& full, const std::vector<std::int64_t>& positions) {
  Shape s = full.shape();
  s[1] = static_cast<std::int64_t>(positions.size());
  Tensor t = Tensor::empty(s, full.dtype(), MemCategory::kWorkspace);
  shard_sequence(full, positions, t.view());
  return t;
}

std::vector<double> gather_full(Communicator& comm, const SequenceLayout& layout, const TensorView& local,
                                const Shape& full_shape, int seq_dim) {
  Tensor full = Tensor::empty(full_shape, local.dtype(), MemCategory::kWorkspace);
  gather_sequence(comm, layout, local, full.view(), seq_dim);
  return to_double(full);
}

MhaResult usp_result(const CpGrid& grid, const MhaShape& s, const MhaProblem& p, const MhaCpConfig& cfg,
                     LayoutKind layout, CpCounters* counters) {
  const CpGroups groups = CpGroups::from(grid);
  return usp_result(grid, s, p, cfg, SequenceLayout::for_groups(groups, s.seq, layout), counters);
}

MhaResult usp_result(const CpGrid& grid, const MhaShape& s, const MhaProblem& p, const MhaCpConfig& cfg,
                     const SequenceLayout& layout, CpCounters* counters, std::vector<Tensor>* local) {
  const CpGroups groups = CpGroups::from(grid);
  MhaCp usp(groups, layout, cfg);
  auto piece = [&](const Tensor& full) { return layout_piece(layout, groups.cp_rank(), full); };
  Tensor q = piece(p.q), k = piece(p.k), v = piece(p.v), dout = piece(p.dout);
  MhaCpOutput o = usp.forward(q.view(), k.view(), v.view());
  MhaCpGrads g = usp.backward(std::move(o.ctx), dout.view());
  if (counters != nullptr) *counters = usp.counters();
  Communicator& sp = grid.cp();
  MhaResult r;
  r.out = gather_full(sp, usp.layout(), o.out.view(), p.q.shape());
  r.lse = gather_full(sp, usp.layout(), o.lse.view(), {s.batch, s.hq, s.seq}, 2);
  r.dq = gather_full(sp, usp.layout(), g.dq.view(), p.q.shape());
  r.dk = gather_full(sp, usp.layout(), g.dk.view(), p.k.shape());
  r.dv = gather_full(sp, usp.layout(), g.dv.view(), p.v.shape());
  if (g.dsinks.defined()) r.dsinks = to_double(g.dsinks.view());
  if (local != nullptr) {
    local->clear();
    for (Tensor* t : {&o.out, &o.lse, &g.dq, &g.dk, &g.dv}) local->push_back(std::move(*t));
  }
  return r;
}

void expect_mha_close(const MhaResult& got, const MhaResult& want, double tol, const std::string& what) {
  const std::pair<const char*, std::vector<double> MhaResult::*> tensors[] = {
      {"out", &MhaResult::out}, {"lse", &MhaResult::lse}, {"dq", &MhaResult::dq},
      {"dk", &MhaResult::dk},   {"dv", &MhaResult::dv},   {"dsinks", &MhaResult::dsinks}};
  for (const auto& [name, field] : tensors) {
    EXPECT_TRUE(all_close(got.*field, want.*field, tol, tol, what + " " + name));
  }
}

void expect_mha_match(const MhaResult& got, const MhaResult& want, DType dtype, const std::string& what) {
  // fp32: both sides compute in fp32 with different block orders, so the differences are rounding only.
  // bf16: results are rounded to bf16 (8-bit mantissa) on both sides: allow a few bf16 ulps of O(1) values.
  const double atol = dtype == DType::kFloat32 ? 2e-5 : 3e-2;
  const double rtol = dtype == DType::kFloat32 ? 1e-4 : 2e-2;
  EXPECT_TRUE(all_close(got.out, want.out, atol, rtol, what + " out"));
  EXPECT_TRUE(all_close(got.lse, want.lse, 1e-5, 1e-5, what + " lse"));  // fp32 on both sides
  EXPECT_TRUE(all_close(got.dq, want.dq, atol, rtol, what + " dq"));
  EXPECT_TRUE(all_close(got.dk, want.dk, atol, rtol, what + " dk"));
  EXPECT_TRUE(all_close(got.dv, want.dv, atol, rtol, what + " dv"));
  // dsinks: a sum over B S rows in another order (fp64 sums of fp32 terms)
  EXPECT_TRUE(all_close(got.dsinks, want.dsinks, 10 * atol, 10 * rtol, what + " dsinks"));
}

}  // namespace seqpar::test
