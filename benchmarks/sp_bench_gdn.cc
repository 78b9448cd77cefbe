// sp_bench's GDN (gated delta rule) workload: chain or scan over the ring group, Ulysses all-to-all over heads,
// through GdnContextParallel (parallel/gdn_cp.h). Inputs q k [B, S, H, K], v [B, S, H, V], g beta [B, S, H],
// initial_state [B, H, K, V], dout [B, S, H, V] (K = V = --head-dim); outputs out, final_state, dq, dk, dv, dg, dbeta,
// dinitial_state. The reference is one attn::gdn_forward + attn::gdn_backward call on the full tensors; the fp64
// reference of --check (sp_bench_check.h) is the token-by-token attn::reference::gdn_forward / gdn_backward.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "attention/gdn.h"
#include "attention/reference/gdn_reference.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs.
enum : std::uint64_t { kIdQ = 11, kIdK = 12, kIdV = 13, kIdG = 14, kIdBeta = 15, kIdState = 16, kIdDout = 17 };

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& o);

class GdnWorkload final : public CpLayerWorkload<GdnCpOutput, GdnCpGrads> {
 public:
  GdnWorkload(const SpBenchOptions& o, const SpGrid& grid)
      : o_(o), grid_(grid), groups_(CpGroups::from(grid)), state_dtype_(attn::gdn_state_dtype(o.dtype)) {
    GdnCpConfig cfg;
    cfg.mode = parse_gdn_cp_mode(o.gdn_mode);
    cfg.chunk_size = o.chunk_size;
    gdn_ = std::make_unique<GdnContextParallel>(groups_, SequenceLayout::for_groups(groups_, o.seq, o.layout), cfg);
  }

  std::vector<TensorSpec> input_specs() const override { return gdn_input_specs(o_); }
  std::vector<std::string> output_names() const override {
    return {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  }

  // Model FLOPs of the chunked algorithm (README): per token and head 6 C K + 4 C V + 6 K V forward.
  double forward_flops() const override {
    const double c = static_cast<double>(std::min(o_.chunk_size, o_.seq)), k = static_cast<double>(o_.head_dim), v = k;
    return static_cast<double>(o_.batch * o_.seq * o_.heads) * (6 * c * k + 4 * c * v + 6 * k * v);
  }
  double backward_flops() const override { return 2.5 * forward_flops(); }

  Tolerance tolerance(const std::string& name) const override {
    // The distributed recurrence composes segment states (chain) or affine maps (scan) in another order than the
    // single-rank chunk loop: differences grow with the number of composed segments, in the state dtype.
    // The state is fp64 for fp64 storage (attn::gdn_state_dtype), so fp64 results agree far below fp32 precision.
    if (o_.dtype == DType::kFloat64) return {1e-12, 1e-10};
    return fp32_accumulator_tolerance(o_.dtype, name);
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = gdn_->layout().local_len();
    const std::vector<std::int64_t>& pos = gdn_->positions();
    const DType t = o_.dtype;
    in_ = local_tensors(t, {qk_shape(local), qk_shape(local), qk_shape(local), gate_shape(local), gate_shape(local)});
    in_.push_back(Tensor::empty(state_shape(), state_dtype_, MemCategory::kModelState));  // initial_state
    in_.push_back(Tensor::empty(qk_shape(local), t, MemCategory::kWorkspace));            // dout
    fill(full, pos, views_of(in_));
  }

  NamedArrays gather_outputs() override {
    NamedArrays r;
    r.emplace_back("out", gather(out_.out, qk_shape(o_.seq)));
    r.emplace_back("final_state", copy(out_.final_state));
    r.emplace_back("dq", gather(grads_.dq, qk_shape(o_.seq)));
    r.emplace_back("dk", gather(grads_.dk, qk_shape(o_.seq)));
    r.emplace_back("dv", gather(grads_.dv, qk_shape(o_.seq)));
    r.emplace_back("dg", gather(grads_.dg, gate_shape(o_.seq)));
    r.emplace_back("dbeta", gather(grads_.dbeta, gate_shape(o_.seq)));
    r.emplace_back("dinitial_state", copy(grads_.dinitial_state));
    return r;
  }

  void reference_setup(const NamedArrays* full) override {
    std::vector<ArraySpec> in;
    for (const TensorSpec& t : gdn_input_specs(o_)) {
      in.push_back({t.name, t.name == "initial_state" ? state_dtype_ : o_.dtype, t.shape});
    }
    ref_in_ = zero_arrays(in);
    fill(full, all_positions(o_.seq), views_of(ref_in_));
    ref_out_ = zero_arrays(output_specs(o_.dtype, state_dtype_));
  }
  void reference_forward() override { attn::gdn_forward(ref_args(), ref("out"), ref("final_state")); }
  void reference_backward() override {
    attn::GdnBackwardArgs b;
    b.fwd = ref_args();
    b.dout = find_array(ref_in_, "dout").view();
    attn::gdn_backward(b, ref("dq"), ref("dk"), ref("dv"), ref("dg"), ref("dbeta"), ref("dinitial_state"));
  }
  NamedArrays reference_outputs() override { return ref_out_; }

  // attn::reference: the token-by-token recurrence in fp64, keeping every state S_t for the backward.
  Fp64ReferenceCost fp64_reference_cost() const override {
    const double states = static_cast<double>(o_.batch * o_.heads) * static_cast<double>(o_.seq + 1) *
                          static_cast<double>(o_.head_dim * o_.head_dim);
    double elems = 0;
    for (const auto& [name, a] : ref_in_) elems += 2.0 * static_cast<double>(a.numel());
    return {8.0 * (elems + 2.0 * states), 30.0 * states};
  }
  NamedArrays fp64_reference_outputs() override {
    const NamedArrays in = widen_to_fp64(ref_in_);
    NamedArrays r = zero_arrays(output_specs(DType::kFloat64, DType::kFloat64));
    attn::GdnBackwardArgs b;
    b.fwd = args_of(in);
    b.dout = find_array(in, "dout").view();
    const std::vector<TensorView> v = views_of(r);
    attn::reference::gdn_forward(b.fwd, v[0], v[1]);
    attn::reference::gdn_backward(b, v[2], v[3], v[4], v[5], v[6], v[7]);
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
  Shape qk_shape(std::int64_t s) const { return {o_.batch, s, o_.heads, o_.head_dim}; }
  Shape gate_shape(std::int64_t s) const { return {o_.batch, s, o_.heads}; }
  Shape state_shape() const { return {o_.batch, o_.heads, o_.head_dim, o_.head_dim}; }

  // Fills q, k, v, g, beta, initial_state, dout (in that order) at `positions` (initial_state is not sharded).
  void fill(const NamedArrays* full, const std::vector<std::int64_t>& positions,
            const std::vector<TensorView>& dst) const {
    const char* names[] = {"q", "k", "v", "g", "beta", "initial_state", "dout"};
    const std::uint64_t ids[] = {kIdQ, kIdK, kIdV, kIdG, kIdBeta, kIdState, kIdDout};
    const std::vector<std::int64_t> heads = all_positions(o_.heads);
    for (int i = 0; i < 7; ++i) {
      const bool is_state = i == 5;
      if (full != nullptr) {
        const npy::HostArray& a = find_array(*full, names[i]);
        if (is_state) {
          copy_convert(a.view(), dst[i]);
        } else {
          shard_from_full(a, positions, dst[i]);
        }
        continue;
      }
      // initial_state [B, H, K, V]: dim 1 is the head, generated like a sequence of H rows.
      fill_random_shard(dst[i], o_.seed, ids[i], is_state ? o_.heads : o_.seq, is_state ? heads : positions);
      if (i == 3) affine_inplace(dst[i], -0.12, 0.1);  // g in [-0.22, -0.02): a decay per token
      if (i == 4) affine_inplace(dst[i], 0.5, 0.3);    // beta in [0.2, 0.8)
      if (i == 5) affine_inplace(dst[i], 0.0, 0.1);    // a small initial state
    }
  }

  TensorView ref(const char* name) const { return find_array(ref_out_, name).view(); }

  // out, final_state, then the gradients, as gather_outputs() orders them.
  std::vector<ArraySpec> output_specs(DType dtype, DType state_dtype) const {
    return {{"out", dtype, qk_shape(o_.seq)},     {"final_state", state_dtype, state_shape()},
            {"dq", dtype, qk_shape(o_.seq)},      {"dk", dtype, qk_shape(o_.seq)},
            {"dv", dtype, qk_shape(o_.seq)},      {"dg", dtype, gate_shape(o_.seq)},
            {"dbeta", dtype, gate_shape(o_.seq)}, {"dinitial_state", state_dtype, state_shape()}};
  }

  attn::GdnForwardArgs args_of(const NamedArrays& in) const {
    attn::GdnForwardArgs a;
    a.q = find_array(in, "q").view();
    a.k = find_array(in, "k").view();
    a.v = find_array(in, "v").view();
    a.g = find_array(in, "g").view();
    a.beta = find_array(in, "beta").view();
    a.initial_state = find_array(in, "initial_state").view();
    a.chunk_size = o_.chunk_size;
    return a;
  }
  attn::GdnForwardArgs ref_args() const { return args_of(ref_in_); }

  npy::HostArray gather(const Tensor& local, const Shape& full_shape) const {
    npy::HostArray full(local.dtype(), full_shape);
    gather_sequence(grid_.sp(), gdn_->layout(), local.view(), full.view(), 1);
    return full;
  }
  static npy::HostArray copy(const Tensor& t) {
    npy::HostArray a(t.dtype(), t.shape());
    copy_convert(t.view(), a.view());
    return a;
  }

  void reset_layer_counters() override { gdn_->reset_counters(); }
  GdnCpOutput run_forward() override {
    return gdn_->forward(in_[kQ], in_[kK], in_[kV], in_[kG], in_[kBeta], in_[kState]);
  }
  GdnCpGrads run_backward(CpContext&& ctx) override { return gdn_->backward(std::move(ctx), in_[kDout]); }
  PhaseCounters forward_counters() override { return counters(); }
  PhaseCounters backward_counters() override { return counters(); }
  PhaseCounters counters() const {
    PhaseCounters p = phase_counters(gdn_->counters());
    p.message_rounds = gdn_->counters().message_rounds;
    return p;
  }

  SpBenchOptions o_;
  const SpGrid& grid_;
  CpGroups groups_;
  DType state_dtype_;
  std::unique_ptr<GdnContextParallel> gdn_;
  enum Input { kQ, kK, kV, kG, kBeta, kState, kDout };
  std::vector<Tensor> in_;  // this rank's q, k, v, g, beta, initial_state, dout
  NamedArrays ref_in_, ref_out_;
};

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& o) {
  const Shape qk{o.batch, o.seq, o.heads, o.head_dim}, gate{o.batch, o.seq, o.heads},
      state{o.batch, o.heads, o.head_dim, o.head_dim};
  return {{"q", qk}, {"k", qk}, {"v", qk}, {"g", gate}, {"beta", gate}, {"initial_state", state}, {"dout", qk}};
}

SEQPAR_WORKLOAD_KIND(GdnWorkload) {
  WorkloadKind k;
  k.name = "gdn";
  k.description = "gated delta rule (chain or scan over the ring, Ulysses over heads)";
  k.presets = {{"qwen3-next", 32, 32, 128, 0, 64, 0, 0, 0,
                "GDN: 32 heads (value heads; key heads shared by pairs), K = V = 128, chunk 64, causal"}};
  k.own_flags = {"gdn-compare-token", "gdn-mode", "chunk-size", "kv-heads"};
  k.input_shape_flags = {{"batch", "q", 0, &SpBenchOptions::batch},
                         {"seq", "q", 1, &SpBenchOptions::seq},
                         {"heads", "q", 2, &SpBenchOptions::heads},
                         {"head-dim", "q", 3, &SpBenchOptions::head_dim}};
  k.input_specs = gdn_input_specs;
  k.validate = [](SpBenchOptions& o) {
    SEQPAR_CHECK(o.heads % o.grid.ulysses_size == 0, "--heads ", o.heads, " must be divisible by --ulysses-size ",
                 o.grid.ulysses_size);
    SEQPAR_CHECK(o.layout != LayoutKind::kStripe, "--layout stripe: GDN needs contiguous segments (use contiguous or ",
                 "zigzag)");
    SEQPAR_CHECK(o.causal || !o.given("causal"), "--causal=false: --attn gdn is a causal recurrence (the state ",
                 "after token t depends on tokens 0..t only)");
  };
  k.add_json = [](const SpBenchOptions& o, nlohmann::json& j) {
    j["shape"]["chunk_size"] = o.chunk_size;
    j["gdn_mode"] = o.gdn_mode;
  };
  k.describe_shapes = [](const SpBenchOptions& o) {
    return str_cat("B=", o.batch, " S=", o.seq, " H=", o.heads, " K=V=", o.head_dim, " chunk=", o.chunk_size,
                   " mode=", o.gdn_mode, " (causal recurrence)");
  };
  return k;
}

}  // namespace

}  // namespace seqpar::bench
