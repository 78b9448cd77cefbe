// sp_bench's GDN (gated delta rule) workload: chain or scan over the ring group, Ulysses all-to-all over heads,
// through GdnCp (parallel/gdn_cp.h). Inputs q k [B, S, Hk, K], v [B, S, Hv, V], g beta [B, S, Hv],
// initial_state [B, Hv, K, V], dout [B, S, Hv, V] (Hv = --heads value heads, Hk = --kv-heads key heads, K =
// --head-dim, V = --dim-v); outputs out, final_state, dq, dk, dv, dg, dbeta, dinitial_state. The reference is one
// attn::gdn_forward + attn::gdn_backward call on the full tensors; the fp64 reference of --check (sp_bench_check.h) is
// the token-by-token attn::reference::gdn_forward / gdn_backward.
// With --conv-width W > 0 (the qwen3-next preset: 4) the layer first runs the short causal depthwise conv with SiLU
// over the channels of q, k and v (Qwen3-Next's conv1d over their concatenation; input conv_weight [C, W] with
// C = 2 Hk K + Hv V, rows in the order q, k, v) through ShortConvCp, and q, k, v are the conv's inputs:
// dq, dk, dv are their gradients and dconv_weight [C, W] is a further output. The references run the same conv with
// attn::short_conv_* (attn::reference::short_conv_* in fp64) before the recurrence.
// Packed rows (--doc-lens, --doc-dist, cu_seqlens.npy; docs/design.md, "GDN on packed rows"): the layer runs on the packed
// layout, every document from its own initial state; initial_state, final_state and dinitial_state are [N, Hv, K, V]
// (one per document, also in --inputs and --dump), and the references are one call over the whole row with
// cu_seqlens (the conv's too): the single-rank packed result.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "attention/gdn.h"
#include "attention/reference/gdn_reference.h"
#include "benchmarks/flop_models.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "runtime/env.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs.
enum : std::uint64_t {
  kIdQ = 11,
  kIdK = 12,
  kIdV = 13,
  kIdG = 14,
  kIdBeta = 15,
  kIdState = 16,
  kIdDout = 17,
  kIdConvWeight = 18
};

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& o);

// The GDN tensor shapes of the options: Hv = --heads value heads, Hk = --kv-heads key heads, K = --head-dim,
// V = --dim-v.
struct GdnShapes {
  std::int64_t B, S, Hv, Hk, K, V;
  std::int64_t N;  // states: one per batch row, or one per document of a packed row
  Shape qk(std::int64_t s) const { return {B, s, Hk, K}; }
  Shape v(std::int64_t s) const { return {B, s, Hv, V}; }
  Shape gate(std::int64_t s) const { return {B, s, Hv}; }
  Shape state() const { return {N, Hv, K, V}; }
  // Conv channels of q, k, v (rows of conv_weight, in that order) and their first row.
  std::int64_t conv_channels(int i) const { return i < 2 ? Hk * K : Hv * V; }
  std::int64_t conv_row(int i) const { return i == 0 ? 0 : i == 1 ? Hk * K : 2 * Hk * K; }
  std::int64_t conv_channels_total() const { return 2 * Hk * K + Hv * V; }
};
GdnShapes gdn_shapes(const SpBenchOptions& o) {
  const std::int64_t states = o.packed() ? static_cast<std::int64_t>(o.doc_lens.size()) : o.batch;
  return {o.batch, o.seq, o.heads, o.kv_heads, o.head_dim, o.dim_v, states};
}

// [B, S, H, D] seen as the conv's [B, S, H D].
TensorView channels_of(const TensorView& t) { return t.reshape({t.dim(0), t.dim(1), t.dim(2) * t.dim(3)}); }

const char* const kQkv[] = {"q", "k", "v"};

class GdnWorkload final : public CpLayerWorkload<GdnCpOutput, GdnCpGrads> {
 public:
  GdnWorkload(const SpBenchOptions& o, const CpGrid& grid)
      : o_(o), grid_(grid), groups_(CpGroups::from(grid)), state_dtype_(accumulator_dtype(o.dtype)) {
    GdnCpConfig cfg;
    cfg.mode = parse_gdn_cp_mode(o.gdn_mode);
    cfg.chunk_size = o.chunk_size;
    cfg.save_inputs = false;  // as the PyTorch module runs it: this workload keeps the inputs for the backward
    const SequenceLayout layout = sp_bench_layout(o);
    gdn_ = std::make_unique<GdnCp>(groups_, layout, cfg);
    if (o.conv_width > 0) conv_ = std::make_unique<ShortConvCp>(groups_, layout);
    if (o.packed()) {
      const std::vector<std::int64_t> cu = cu_seqlens_of(o.doc_lens);
      cu_seqlens_ = Tensor::empty({static_cast<std::int64_t>(cu.size())}, DType::kInt64, MemCategory::kWorkspace);
      std::copy(cu.begin(), cu.end(), cu_seqlens_.data_as<std::int64_t>());
    }
  }

  std::vector<TensorSpec> input_specs() const override { return gdn_input_specs(o_); }
  void release_outputs() override {
    CpLayerWorkload::release_outputs();
    for (ShortConvCpOutput& c : conv_out_) c = ShortConvCpOutput{};
    dconv_weight_ = Tensor();
  }
  std::vector<std::string> output_names() const override {
    std::vector<std::string> names;
    for (const ArraySpec& a : output_specs(o_.dtype, state_dtype_)) names.push_back(a.name);
    return names;
  }

  // Model FLOPs of the chunked algorithm (benchmarks/flop_models.h, docs/benchmarks.md, "Definitions of the benchmark figures"), the conv included.
  GdnFlopShape flop_shape() const {
    return {o_.batch,      o_.seq,
            o_.heads,      o_.head_dim,
            o_.dim_v,      std::min(o_.chunk_size, attn::kGdnMaxChunkSize),
            o_.conv_width, gdn_shapes(o_).conv_channels_total()};
  }
  double forward_flops() const override { return gdn_forward_flops(flop_shape()); }
  double backward_flops() const override { return gdn_backward_flops(flop_shape()); }

  Tolerance tolerance(const std::string& name) const override {
    // The distributed recurrence composes segment states (chain) or affine maps (scan) in another order than the
    // single-rank chunk loop: differences grow with the number of composed segments, in the state dtype.
    // The state is fp64 for fp64 storage (accumulator_dtype), so fp64 results agree far below fp32 precision.
    if (o_.dtype == DType::kFloat64) return kFp64Tolerance;
    return fp32_accumulator_tolerance(o_.dtype, name);
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = gdn_->layout().local_len();
    // This rank's token of every local row (-1: a padding row, filled with zeros).
    const std::vector<std::int64_t> pos = gdn_->layout().token_index(groups_.cp_rank());
    const DType t = o_.dtype;
    in_ = local_tensors(t, {qk_shape(local), qk_shape(local), v_shape(local), gate_shape(local), gate_shape(local)});
    in_.push_back(Tensor::empty(state_shape(), state_dtype_, MemCategory::kModelState));  // initial_state
    in_.push_back(Tensor::empty(v_shape(local), t, MemCategory::kWorkspace));             // dout
    if (conv_) in_.push_back(Tensor::empty(conv_weight_shape(), t, MemCategory::kModelState));
    fill(full, pos, views_of(in_));
  }

  NamedArrays gather_outputs() override {
    NamedArrays r;
    r.emplace_back("out", gather(out_.out, v_shape(o_.seq)));
    r.emplace_back("final_state", copy(out_.final_state));
    r.emplace_back("dq", gather(grads_.dq, qk_shape(o_.seq)));
    r.emplace_back("dk", gather(grads_.dk, qk_shape(o_.seq)));
    r.emplace_back("dv", gather(grads_.dv, v_shape(o_.seq)));
    r.emplace_back("dg", gather(grads_.dg, gate_shape(o_.seq)));
    r.emplace_back("dbeta", gather(grads_.dbeta, gate_shape(o_.seq)));
    r.emplace_back("dinitial_state", copy(grads_.dinitial_state));
    if (conv_) r.emplace_back("dconv_weight", copy(dconv_weight_));
    return r;
  }

  NamedArrays make_full_inputs() const override { return full_inputs(nullptr); }

  void reference_setup(const NamedArrays* full) override {
    ref_in_ = full_inputs(full);
    ref_out_ = zero_arrays(output_specs(o_.dtype, state_dtype_));
  }
  void reference_forward() override {
    if (conv_) ref_conv_ = conv_forward(ref_in_, false);
    attn::gdn_forward(args_of(ref_in_, ref_conv_), ref("out"), ref("final_state"));
  }
  void reference_backward() override {
    attn::GdnBackwardArgs b;
    b.fwd = args_of(ref_in_, ref_conv_);
    b.dout = find_array(ref_in_, "dout").view();
    if (!conv_) {
      attn::gdn_backward(b, ref("dq"), ref("dk"), ref("dv"), ref("dg"), ref("dbeta"), ref("dinitial_state"));
      return;
    }
    const NamedArrays dy = zero_like_qkv(ref_in_);
    attn::gdn_backward(b, dy[0].second.view(), dy[1].second.view(), dy[2].second.view(), ref("dg"), ref("dbeta"),
                       ref("dinitial_state"));
    conv_backward(ref_in_, dy, ref_out_, false);
  }
  NamedArrays reference_outputs() override { return ref_out_; }

  NamedArrays fp64_reference_outputs() override {
    const NamedArrays in = widen_to_fp64(ref_in_);
    NamedArrays r = zero_arrays(output_specs(DType::kFloat64, DType::kFloat64));
    const NamedArrays conv = conv_ ? conv_forward(in, true) : NamedArrays();
    attn::GdnBackwardArgs b;
    b.fwd = args_of(in, conv);
    b.dout = find_array(in, "dout").view();
    const std::vector<TensorView> v = views_of(r);
    attn::reference::gdn_forward(b.fwd, v[0], v[1]);
    if (!conv_) {
      attn::reference::gdn_backward(b, v[2], v[3], v[4], v[5], v[6], v[7]);
      return r;
    }
    const NamedArrays dy = zero_like_qkv(in);
    attn::reference::gdn_backward(b, dy[0].second.view(), dy[1].second.view(), dy[2].second.view(), v[5], v[6], v[7]);
    conv_backward(in, dy, r, true);
    return r;
  }

  // --gdn-compare-token: the single-rank chunked kernel on the whole problem at the configured chunk size, and the
  // token-by-token recurrence run by the same kernel with chunk_size = 1 (same inputs, same dtype, same threads).
  std::vector<VariantTiming> time_variants(const NamedArrays* full, int warmup, int iters) override {
    if (!o_.gdn_compare_token) return {};
    if (ref_in_.empty()) reference_setup(full);
    std::vector<VariantTiming> r;
    for (const std::int64_t chunk : {o_.chunk_size, std::int64_t{1}}) {
      std::vector<double> f, b;
      for (int i = 0; i < warmup + iters; ++i) {
        const double t0 = now_s();
        attn::GdnForwardArgs a = ref_args();
        a.chunk_size = chunk;
        attn::gdn_forward(a, ref("out"), ref("final_state"));
        const double t1 = now_s();
        attn::GdnBackwardArgs bw;
        bw.fwd = a;
        bw.dout = find_array(ref_in_, "dout").view();
        attn::gdn_backward(bw, ref("dq"), ref("dk"), ref("dv"), ref("dg"), ref("dbeta"), ref("dinitial_state"));
        const double t2 = now_s();
        if (i < warmup) continue;
        f.push_back(t1 - t0);
        b.push_back(t2 - t1);
      }
      r.push_back({chunk == 1 ? std::string("token-by-token (chunk 1)") : str_cat("chunked (chunk ", chunk, ")"),
                   1e3 * median(f), 1e3 * median(b)});
      if (chunk == 1) break;  // --chunk-size 1: one row
    }
    return r;
  }

 private:
  Shape qk_shape(std::int64_t s) const { return gdn_shapes(o_).qk(s); }
  Shape v_shape(std::int64_t s) const { return gdn_shapes(o_).v(s); }
  Shape gate_shape(std::int64_t s) const { return gdn_shapes(o_).gate(s); }
  Shape state_shape() const { return gdn_shapes(o_).state(); }
  Shape conv_weight_shape() const { return {gdn_shapes(o_).conv_channels_total(), o_.conv_width}; }
  // Rows of q (0), k (1) or v (2) of a [C, W] conv weight or its gradient.
  TensorView conv_rows(const TensorView& w, int i) const {
    const GdnShapes d = gdn_shapes(o_);
    return w.slice0(d.conv_row(i), d.conv_row(i) + d.conv_channels(i));
  }

  // silu(conv(x)) of q, k and v of `in` with their rows of in's conv_weight, by the kernels or (fp64_reference) the
  // fp64 references; named q, k, v.
  NamedArrays conv_forward(const NamedArrays& in, bool fp64_reference) const {
    NamedArrays r = zero_like_qkv(in);
    for (int i = 0; i < 3; ++i) {
      attn::ShortConvArgs a;
      a.x = channels_of(find_array(in, kQkv[i]).view());
      a.weight = conv_rows(find_array(in, "conv_weight").view(), i);
      a.cu_seqlens = cu_seqlens_.view();
      const TensorView y = channels_of(r[i].second.view());
      if (fp64_reference) {
        attn::reference::short_conv_forward(a, y, {});
      } else {
        attn::short_conv_forward(a, y, {});
      }
    }
    return r;
  }
  // The conv's backward from dy (the recurrence's gradients of the convolved q, k, v) into dq, dk, dv and
  // dconv_weight of `out`.
  void conv_backward(const NamedArrays& in, const NamedArrays& dy, const NamedArrays& out, bool fp64_reference) const {
    for (int i = 0; i < 3; ++i) {
      attn::ShortConvArgs a;
      a.x = channels_of(find_array(in, kQkv[i]).view());
      a.weight = conv_rows(find_array(in, "conv_weight").view(), i);
      a.cu_seqlens = cu_seqlens_.view();
      const TensorView dx = channels_of(find_array(out, std::string("d") + kQkv[i]).view());
      const TensorView dw = conv_rows(find_array(out, "dconv_weight").view(), i);
      if (fp64_reference) {
        attn::reference::short_conv_backward(a, channels_of(dy[i].second.view()), dx, dw, {});
      } else {
        attn::short_conv_backward(a, channels_of(dy[i].second.view()), dx, dw, {});
      }
    }
  }
  // Zero arrays shaped and typed like q, k, v of `in`.
  static NamedArrays zero_like_qkv(const NamedArrays& in) {
    std::vector<ArraySpec> specs;
    for (const char* name : kQkv) {
      const npy::HostArray& a = find_array(in, name);
      specs.push_back({name, a.dtype, a.shape});
    }
    return zero_arrays(specs);
  }

  // Fills q, k, v, g, beta, initial_state, dout and (with the conv) conv_weight, in that order, at `positions`
  // (initial_state and conv_weight are not sharded).
  void fill(const NamedArrays* full, const std::vector<std::int64_t>& positions,
            const std::vector<TensorView>& dst) const {
    const char* names[] = {"q", "k", "v", "g", "beta", "initial_state", "dout", "conv_weight"};
    const std::uint64_t ids[] = {kIdQ, kIdK, kIdV, kIdG, kIdBeta, kIdState, kIdDout, kIdConvWeight};
    const std::int64_t channels = gdn_shapes(o_).conv_channels_total();
    for (int i = 0; i < static_cast<int>(dst.size()); ++i) {
      const bool is_state = i == 5, is_weight = i == 7;
      if (full != nullptr) {
        const npy::HostArray& a = find_array(*full, names[i]);
        if (is_state || is_weight) {
          copy_convert(a.view(), dst[i]);
        } else {
          shard_from_full(a, positions, dst[i]);
        }
        continue;
      }
      if (is_state || is_weight) {
        // initial_state [B or N, H, K, V]: dim 1 is the head, generated like a sequence of H rows; conv_weight [C, W]
        // as [1, C, W], a sequence of C rows.
        const std::int64_t rows = is_state ? o_.heads : channels;
        const TensorView t = is_state ? dst[i] : dst[i].reshape({1, channels, o_.conv_width});
        fill_random_shard(t, o_.seed, ids[i], rows, all_positions(rows));
      } else {
        fill_random_shard(dst[i], o_.seed, ids[i], o_.seq, positions);
      }
      if (i == 3) affine_inplace(dst[i], -0.12, 0.1);  // g in [-0.22, -0.02): a decay per token
      if (i == 4) affine_inplace(dst[i], 0.5, 0.3);    // beta in [0.2, 0.8)
      if (i == 5) affine_inplace(dst[i], 0.0, 0.1);    // a small initial state
      if (i == 7) affine_inplace(dst[i], 0.0, 0.5);    // conv weights in [-0.5, 0.5)
    }
  }

  TensorView ref(const char* name) const { return find_array(ref_out_, name).view(); }

  // The whole problem's inputs (initial_state in the state dtype), from `full` or the seed.
  NamedArrays full_inputs(const NamedArrays* full) const {
    std::vector<ArraySpec> in;
    for (const TensorSpec& t : gdn_input_specs(o_)) {
      in.push_back({t.name, t.name == "initial_state" ? state_dtype_ : o_.dtype, t.shape});
    }
    NamedArrays r = zero_arrays(in);
    fill(full, all_positions(o_.seq), views_of(r));
    return r;
  }

  // out, final_state, then the gradients, as gather_outputs() orders them.
  std::vector<ArraySpec> output_specs(DType dtype, DType state_dtype) const {
    std::vector<ArraySpec> r = {{"out", dtype, v_shape(o_.seq)},      {"final_state", state_dtype, state_shape()},
                                {"dq", dtype, qk_shape(o_.seq)},      {"dk", dtype, qk_shape(o_.seq)},
                                {"dv", dtype, v_shape(o_.seq)},       {"dg", dtype, gate_shape(o_.seq)},
                                {"dbeta", dtype, gate_shape(o_.seq)}, {"dinitial_state", state_dtype, state_shape()}};
    if (o_.conv_width > 0) r.push_back({"dconv_weight", dtype, conv_weight_shape()});
    return r;
  }

  // The recurrence's arguments from `in`, with q, k, v from `qkv` when it is not empty (the convolved ones).
  attn::GdnForwardArgs args_of(const NamedArrays& in, const NamedArrays& qkv = {}) const {
    const NamedArrays& src = qkv.empty() ? in : qkv;
    attn::GdnForwardArgs a;
    a.q = find_array(src, "q").view();
    a.k = find_array(src, "k").view();
    a.v = find_array(src, "v").view();
    a.g = find_array(in, "g").view();
    a.beta = find_array(in, "beta").view();
    a.initial_state = find_array(in, "initial_state").view();
    a.chunk_size = o_.chunk_size;
    a.cu_seqlens = cu_seqlens_.view();  // empty unless packed
    return a;
  }
  attn::GdnForwardArgs ref_args() const { return args_of(ref_in_); }  // the recurrence alone (no conv)

  npy::HostArray gather(const Tensor& local, const Shape& full_shape) const {
    npy::HostArray full(local.dtype(), full_shape);
    gather_sequence(grid_.cp(), gdn_->layout(), local.view(), full.view(), 1);
    return full;
  }
  static npy::HostArray copy(const Tensor& t) {
    npy::HostArray a(t.dtype(), t.shape());
    copy_convert(t.view(), a.view());
    return a;
  }

  void reset_layer_counters() override { gdn_->reset_counters(); }
  GdnCpOutput run_forward() override {
    gdn_in_ = {in_[kQ], in_[kK], in_[kV], in_[kG], in_[kBeta]};
    if (conv_) {
      for (int i = 0; i < 3; ++i) {
        conv_out_[i] = conv_->forward(channels_of(in_[i].view()), conv_rows(in_[kConvWeight].view(), i));
      }
      gdn_in_.q = conv_out_[0].out.view().reshape(in_[kQ].shape());
      gdn_in_.k = conv_out_[1].out.view().reshape(in_[kK].shape());
      gdn_in_.v = conv_out_[2].out.view().reshape(in_[kV].shape());
    }
    return gdn_->forward(gdn_in_.q, gdn_in_.k, gdn_in_.v, gdn_in_.g, gdn_in_.beta, in_[kState]);
  }
  GdnCpGrads run_backward(CpContext&& ctx) override {
    GdnCpGrads g = gdn_->backward(std::move(ctx), in_[kDout], {}, gdn_in_);
    if (!conv_) return g;
    dconv_weight_ = Tensor::empty(conv_weight_shape(), o_.dtype, MemCategory::kWorkspace);
    Tensor* d[3] = {&g.dq, &g.dk, &g.dv};
    for (int i = 0; i < 3; ++i) {
      const Tensor dx =
          conv_->backward(std::move(conv_out_[i].ctx), channels_of(d[i]->view()), conv_rows(dconv_weight_.view(), i));
      *d[i] = Tensor::copy_of(dx.view().reshape(d[i]->shape()), dx.dtype(), MemCategory::kWorkspace);
    }
    return g;
  }
  PhaseCounters forward_counters() override { return phase_counters_with_rounds(gdn_->counters()); }
  PhaseCounters backward_counters() override { return phase_counters_with_rounds(gdn_->counters()); }

  SpBenchOptions o_;
  const CpGrid& grid_;
  CpGroups groups_;
  DType state_dtype_;
  std::unique_ptr<GdnCp> gdn_;
  std::unique_ptr<ShortConvCp> conv_;  // --conv-width > 0
  ShortConvCpOutput conv_out_[3];                   // the convolved q, k, v of the last forward, with their contexts
  GdnCpInputs gdn_in_;  // the last forward's q, k, v, g, beta (the convolved q, k, v), handed back to the backward
  Tensor dconv_weight_;
  enum Input { kQ, kK, kV, kG, kBeta, kState, kDout, kConvWeight };
  std::vector<Tensor> in_;  // this rank's q, k, v, g, beta, initial_state, dout (, conv_weight)
  Tensor cu_seqlens_;       // a packed row's cu_seqlens (int64 [N+1]) for the references; undefined otherwise
  NamedArrays ref_in_, ref_out_;
  NamedArrays ref_conv_;  // the single-rank reference's convolved q, k, v
};

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& o) {
  const GdnShapes d = gdn_shapes(o);
  std::vector<TensorSpec> r = {{"q", d.qk(d.S)},   {"k", d.qk(d.S)},      {"v", d.v(d.S)},
                               {"g", d.gate(d.S)}, {"beta", d.gate(d.S)}, {"initial_state", d.state()},
                               {"dout", d.v(d.S)}};
  if (o.conv_width > 0) r.push_back({"conv_weight", {d.conv_channels_total(), o.conv_width}});
  return r;
}

// What GdnWorkload's step holds on one rank (sp_bench_memory.h), following GdnCp (parallel/gdn_cp.cc)
// and the chunked kernel (attention/cpu/gdn_chunk.cc): xk = one of q, k ([B, S/P, Hk, K]), xv = one of v, dout, out
// ([B, S/P, Hv, V]), per segment (zigzag: two per rank) a state [B, Hv/Pu, K, V] in the state dtype, per thread one
// chunk scratch of [C, C], [C, K] and [K, V] buffers (backward: also the start state of every chunk of a segment).
// attn::reference: the token-by-token recurrence in fp64, keeping every state S_t for the backward; the inputs and
// their gradients in fp64.
Fp64ReferenceCost gdn_reference_cost(const SpBenchOptions& o) {
  const double states = static_cast<double>(o.batch * o.heads) * static_cast<double>(o.seq + 1) *
                        static_cast<double>(o.head_dim * o.dim_v);
  return {8.0 * (2.0 * spec_elements(gdn_input_specs(o)) + 2.0 * states), 30.0 * states};
}

// The segments of the ring shards (maximal runs of consecutive tokens; zigzag: two per document and rank): the most
// any ring rank holds, and the longest's share of a ring shard's rows.
struct RingSegments {
  double most = 1, longest_share = 1;
  bool maps = false;  // the scan computes a segment map (which reads head-major copies of the inputs)
};
RingSegments ring_segments(const SpBenchOptions& o) {
  const SequenceLayout layout = sp_bench_layout(o);
  std::vector<std::vector<std::int64_t>> tokens;
  for (int r = 0; r < layout.ring_size(); ++r) tokens.push_back(layout.tokens_of_slots(layout.ring_shard_positions(r)));
  std::vector<double> count(tokens.size(), 0);
  std::int64_t longest = 0;
  const std::span<const std::int64_t> cu_span = layout.cu_seqlens();
  const std::vector<std::int64_t> cu(cu_span.begin(), cu_span.end());
  std::vector<std::vector<SegmentPiece>> pieces;
  for (const Segment& seg : segments_in_global_order(tokens)) {
    count[static_cast<std::size_t>(seg.owner)] += 1;
    longest = std::max(longest, seg.length);
    pieces.push_back(segment_pieces(seg, cu));
  }
  RingSegments r;
  if (o.gdn_mode == "scan") {
    for (int dir : {+1, -1}) {
      const GdnScanPlan plan = gdn_scan_plan(pieces, dir);
      for (int i = 0; i < static_cast<int>(pieces.size()); ++i) r.maps = r.maps || plan.computes_map(i);
    }
  }
  r.most = std::max(1.0, *std::max_element(count.begin(), count.end()));
  r.longest_share = std::min(1.0, static_cast<double>(longest) / static_cast<double>(tokens[0].size()));
  return r;
}

WorkloadMemory gdn_memory(const SpBenchOptions& o) {
  const double e = static_cast<double>(dtype_size(o.dtype)), pu = o.grid.ulysses_size, pr = o.grid.ring_size;
  const double st = static_cast<double>(dtype_size(accumulator_dtype(o.dtype)));
  const double c = o.dtype == DType::kFloat64 ? 8 : 4, threads = o.threads, batch = static_cast<double>(o.batch);
  // S: the layout's padded length (padding rows are allocated like tokens; the host arrays hold o.seq rows)
  const double s_pad = static_cast<double>(sp_bench_padded_len(o)), unpad = static_cast<double>(o.seq) / s_pad;
  const GdnShapes d = gdn_shapes(o);
  const double sl = s_pad / (pu * pr), kd = static_cast<double>(d.K), vd = static_cast<double>(d.V);
  // xk: one of q, k (key heads; in the heads layout each rank holds at least one, replicated when Pu > Hk); xv: one
  // of v, dout, out (value heads)
  const double xk = e * batch * sl * static_cast<double>(std::max<std::int64_t>(d.Hk, o.grid.ulysses_size)) * kd;
  const double xv = e * batch * sl * o.heads * vd, qkv = 2 * xk + xv, gate = e * batch * sl * o.heads;
  // initial_state, final_state, dinitial_state: one per batch row or per document
  const double state = st * static_cast<double>(d.N) * o.heads * kd * vd;
  const RingSegments ring_segs = ring_segments(o);
  const double segments = ring_segs.most;
  const double seg_state = st * batch * (o.heads / pu) * kd * std::max(kd, vd);  // a state, or a scan map's M
  const double chunk = static_cast<double>(attn::gdn_run_chunk_size(o.chunk_size, o.seq));
  const double m = std::max({chunk, kd, vd});
  const double seg_len = s_pad / (pr * segments);
  const double fwd_worker = c * (17 * chunk * m + 3 * m * m + 16 * chunk);
  const double bwd_worker = fwd_worker + c * (17 * chunk * m + 3 * m * m + std::ceil(seg_len / chunk) * kd * vd);
  const double a2a = pu > 1 ? 2 * std::max(xk, xv) : 0;
  // dq and dk per value head when value heads share key heads (Hv > Hk), in the state dtype, summed into the key heads
  // afterwards (GdnCp's backward; one transposed copy at a time).
  const double grouped = d.Hv > d.Hk ? 2 * c * batch * sl * o.heads * kd : 0;
  // With the lean backward (SEQPAR_GDN_LEAN_BACKWARD; fp32 / fp64 gradients, or replicated key heads, summed in the
  // accumulation dtype) each key head's sum goes straight into dq, dk of the key heads; else one transposed copy at a
  // time (half of `grouped`).
  const bool lean_sums = env::gdn_lean_backward() &&
                         (o.dtype == DType::kFloat32 || o.dtype == DType::kFloat64 || d.Hk < o.grid.ulysses_size);
  const double grouped_sum = d.Hv <= d.Hk ? 0 : lean_sums ? 2 * c * xk / e : 0.5 * grouped;
  // The scan keeps every needed map of every head until its messages are sent, the chain a state per head and segment.
  const double ring = o.gdn_mode == "scan" ? 3 * segments * seg_state : 2 * segments * seg_state;
  // GdnCp runs one value head at a time on its inputs in place (attn::gdn_forward_window); only a segment map reads
  // head-major copies of the inputs (q k v g beta; backward: and dout) and one head's rows of a segment.
  const double heads_local = std::max(1.0, o.heads / pu);
  const double maps = ring_segs.maps ? 1 : 0;
  // --conv-width (ShortConvCp on the sequence shards, once for each of q, k, v): through both phases,
  // each context's copy of its input and halo states ([B, W - 1, C] per segment) and the convolved q, k, v;
  // conv_weight an input, its gradient an output. The conv's own buffers come before the recurrence's forward and
  // after its backward (whose workspace is freed by then), for one of q, k, v at a time (the widest, `wide` channels):
  // forward a segment's rows and their result; backward, in the accumulation dtype, dx and a segment's x, dout and dx,
  // in the storage dtype a taken row block, the result and its copy.
  const double conv = o.conv_width > 0 ? 1 : 0, rows = batch * sl;
  const double conv_in = conv * e * rows * static_cast<double>(d.conv_channels_total());
  const double conv_weight = conv * e * static_cast<double>(d.conv_channels_total()) * o.conv_width;
  const double halo = conv * e * batch * static_cast<double>(d.conv_channels_total()) * (o.conv_width - 1) * segments;
  const double wide = static_cast<double>(std::max(d.Hk * d.K, d.Hv * d.V));
  const double conv_fwd = conv * 2 * e * rows * wide, conv_bwd = conv * (4 * c + 3 * e) * rows * wide;
  // The work ahead (GdnCp, attn::GdnAhead) on a rank that waits (ring_size > 1): up to kGdnAheadMaxWindows windows of
  // the longest segment and one value head, under kGdnAheadBudgetBytes (one at least). Forward: per chunk the
  // scaled q, W, K~ [C, K], U [C, V], P [C, C] and exp(gamma) [C]; backward: per chunk a start state [K, V].
  const double win_len = ring_segs.longest_share * s_pad / pr, win_chunks = std::ceil(win_len / chunk);
  const double ahead_fwd_window = c * batch * win_chunks * chunk * (3 * kd + vd + chunk + 1);
  const double ahead_bwd_window = c * batch * win_chunks * kd * vd;
  // (none with SEQPAR_GDN_WORK_AHEAD=0, which turns the work ahead off)
  const bool ahead_on = env::gdn_work_ahead();
  auto ahead_windows = [&](double per_window) {
    const double fit = std::max(1.0, std::floor(static_cast<double>(kGdnAheadBudgetBytes) / per_window));
    return pr > 1 && ahead_on ? std::min({static_cast<double>(kGdnAheadMaxWindows), fit, heads_local * segments})
                              : 0.0;
  };
  const double ahead_fwd = ahead_windows(ahead_fwd_window) * ahead_fwd_window;
  const double ahead_bwd = ahead_windows(ahead_bwd_window) * ahead_bwd_window;
  WorkloadMemory m_;
  m_.inputs = qkv + xv + 2 * gate + state + conv_weight;  // q, k, v, dout, g, beta, initial_state (, conv_weight)
  // Forward: the context keeps q k v g beta in the heads layout at ulysses_size > 1 (at 1 they are the caller's,
  // handed back to the backward: GdnCpConfig::save_inputs false) and the segments' start states (and scan maps);
  // out_h, the output out and final_state, for maps the head-major inputs and one head's rows of a segment; the
  // exchanged states.
  const double saved = (pu > 1 ? qkv + 2 * gate : 0.0) + 2 * segments * seg_state + conv_in + halo;
  m_.forward.saved = saved;
  m_.forward.outputs = xv + state;
  // (at ulysses_size 1 out_h is the output out: one buffer)
  const double out_buffers = pu > 1 ? 2 : 1;
  m_.forward.workspace =
      std::max(out_buffers * xv + maps * (qkv + 2 * gate) * (1 + ring_segs.longest_share / heads_local) +
                   2 * segments * seg_state + threads * fwd_worker + ahead_fwd,
               conv_fwd) +
      conv_in;
  m_.forward.comm = a2a + ring;
  // Backward: out and final_state stay held; dout_h, the gradients in the heads layout (dq, dk per value head, summed
  // per key head when Hv > Hk: `grouped` and `grouped_sum`), for maps the head-major inputs and dout, the
  // outputs dq dk dv dg dbeta dinitial_state (, dconv_weight).
  m_.backward.saved = saved;
  m_.backward.outputs = xv + state + qkv + 2 * gate + state + conv_weight;
  // (at ulysses_size 1 the lean backward reads the caller's dout: no dout_h)
  const double dout_buffers = pu == 1 && env::gdn_lean_backward() ? 0 : 1;
  m_.backward.workspace =
      std::max((1 + dout_buffers) * xv + 2 * gate + 2 * xk + grouped + grouped_sum + maps * (qkv + 2 * gate + xv) * 2 +
                   2 * segments * seg_state + threads * bwd_worker + ahead_bwd,
               conv_bwd) +
      conv_in;
  m_.backward.comm = a2a + ring;
  m_.full_inputs = (qkv + xv + 2 * gate) * pu * pr * unpad + state;
  m_.full_outputs = (qkv + xv + 2 * gate) * pu * pr * unpad + 2 * state;  // out, dq, dk, dv, dg, dbeta; the two states
  m_.reference_scratch = threads * bwd_worker;
  return m_;
}

SEQPAR_WORKLOAD_KIND(GdnWorkload) {
  WorkloadKind k;
  k.name = "gdn";
  k.description = "gated delta rule (chain or scan over the ring, Ulysses over value heads)";
  k.presets = {{"qwen3-next", 32, 16, 128, 0, 64, 128, 0, 0,
                "GDN: 32 value heads on 16 key heads (each q, k head serves two value heads), K = V = 128, short conv "
                "of width 4 on q, k, v, chunk 64, causal",
                4, std::nullopt}};
  k.own_flags = {"gdn-compare-token", "gdn-mode", "chunk-size", "kv-heads", "dim-v", "conv-width"};
  k.warnings = [](const SpBenchOptions& o) {
    std::vector<std::string> w;
    // The chunk the kernel runs (attention/gdn.h); a chunk of at most the default, or over a sequence no longer
    // than it, costs what the default does.
    const std::int64_t chunk = attn::gdn_run_chunk_size(o.chunk_size, o.seq);
    if (chunk > attn::kGdnDefaultChunkSize) {
      w.push_back(str_cat(
          "--chunk-size ", o.chunk_size, preset_note(o, "chunk-size"),
          ": the chunked GDN kernel's work per token grows with the chunk (O(C (K + V + C)) for ",
          "chunks of C tokens)",
          o.chunk_size > attn::kGdnMaxChunkSize
              ? str_cat("; chunks above ", attn::kGdnMaxChunkSize, " tokens run as chunks of ", attn::kGdnMaxChunkSize)
              : std::string(),
          "; --chunk-size ", attn::kGdnDefaultChunkSize, " (the default) is faster"));
    }
    return w;
  };
  k.input_shape_flags = {{"batch", "q", 0, &SpBenchOptions::batch},
                         {"seq", "q", 1, &SpBenchOptions::seq},
                         {"kv-heads", "q", 2, &SpBenchOptions::kv_heads},
                         {"head-dim", "q", 3, &SpBenchOptions::head_dim},
                         {"heads", "v", 2, &SpBenchOptions::heads},
                         {"dim-v", "v", 3, &SpBenchOptions::dim_v},
                         {"conv-width", "conv_weight", 1, &SpBenchOptions::conv_width, /*optional_file=*/true}};
  k.input_specs = gdn_input_specs;
  // The recurrence's domain: g is the log decay (a decay exp(g) in (0, 1]), beta the write strength.
  k.input_value_rule = [](const std::string& tensor, double x) -> std::string {
    if (tensor == "g" && !(x <= 0)) return "--attn gdn: g is the log decay, every element must be <= 0";
    if (tensor == "beta" && !(x > 0 && x < 1)) return "--attn gdn: beta must be in (0, 1)";
    return "";
  };
  k.estimate_memory = gdn_memory;
  k.fp64_reference_cost = gdn_reference_cost;
  k.validate = [](SpBenchOptions& o) {
    if (o.dim_v == 0) o.dim_v = o.head_dim;
    SEQPAR_CHECK(o.dim_v >= 1, "--dim-v ", o.dim_v, ": must be >= 1");
    SEQPAR_CHECK(o.heads % o.kv_heads == 0, "--heads ", o.heads, preset_note(o, "heads"),
                 " (GDN value heads) must be a multiple of --kv-heads ", o.kv_heads, preset_note(o, "kv-heads"),
                 " (GDN key heads: value head h reads key head h / (heads / kv-heads))");
    const int pu = o.grid.ulysses_size;
    SEQPAR_CHECK(o.heads % pu == 0, "--heads ", o.heads, preset_note(o, "heads"),
                 " (GDN value heads) must be divisible by --ulysses-size ", pu);
    SEQPAR_CHECK(o.kv_heads % pu == 0 || pu % o.kv_heads == 0, "--kv-heads ", o.kv_heads, preset_note(o, "kv-heads"),
                 " (GDN key heads) must be divisible by --ulysses-size ", pu,
                 " or divide it (then each key head is replicated)");
    SEQPAR_CHECK(o.layout != LayoutKind::kStripe, "--layout stripe: GDN needs contiguous segments (use contiguous, ",
                 "zigzag or balanced)");
    // The conv's window reaches W - 1 tokens back: a segment's halo is those rows from the ranks before it, however
    // many hold them (docs/design.md, "Short conv halo"). Taps before the sequence's start read only the zero initial
    // conv state, while the kernel's work (S W C) and the halo plan (W - 1 rows a segment) still grow with W.
    SEQPAR_CHECK(o.decode.mode == "decode" || o.conv_width <= o.seq, "--conv-width ", o.conv_width,
                 preset_note(o, "conv-width"), " must be <= --seq ", o.seq,
                 ": the short conv reaches W - 1 tokens back, and taps before the sequence's start read only zeros");
    SEQPAR_CHECK(o.causal || !o.given("causal"), "--causal=false: --attn gdn is a causal recurrence (the state ",
                 "after token t depends on tokens 0..t only)");
  };
  k.add_json = [](const SpBenchOptions& o, nlohmann::json& j) {
    j["shape"]["chunk_size"] = o.chunk_size;
    j["shape"]["dim_v"] = o.dim_v;
    j["shape"]["conv_width"] = o.conv_width;
    j["gdn_mode"] = o.gdn_mode;
  };
  k.describe_shapes = [](const SpBenchOptions& o) {
    return str_cat("B=", o.batch, " S=", o.seq, o.packed() ? str_cat(" docs=", o.doc_lens.size()) : std::string(),
                   " Hv=", o.heads, " Hk=", o.kv_heads, " K=", o.head_dim, " V=", o.dim_v, " conv=", o.conv_width,
                   " chunk=", o.chunk_size, " mode=", o.gdn_mode, " (causal recurrence)");
  };
  return k;
}

}  // namespace

// GDN's own flags of `group` (sp_bench --help order; the registry: add_sp_bench_flags in sp_bench_options.cc).
void add_gdn_flags(cxxopts::Options& spec, FlagGroup group) {
  // clang-format off
  if (group == FlagGroup::kProblem) {
    spec.add_options("problem")
      ("chunk-size", "GDN: chunk length", cxxopts::value<std::int64_t>()->default_value("64"))
      ("conv-width", "GDN: width W of the short causal depthwise conv (with SiLU) on q, k and v before the "
                     "recurrence (0: none)", cxxopts::value<std::int64_t>()->default_value("0"));
  } else if (group == FlagGroup::kParallel) {
    spec.add_options("parallel")
      ("gdn-mode", "GDN state passing: chain | scan (the default is GdnCpConfig's)",
       cxxopts::value<std::string>()->default_value("scan"));
  } else if (group == FlagGroup::kRun) {
    spec.add_options("run")
      ("gdn-compare-token", "GDN: also time the single-rank chunked kernel on the whole problem against the "
                            "token-by-token recurrence (the same kernel with chunk size 1), on rank 0");
  }
  // clang-format on
}

}  // namespace seqpar::bench
