#include "benchmarks/sp_bench_gdn.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "attention/gdn.h"
#include "parallel/gdn_cp.h"
#include "parallel/layout.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs.
enum : std::uint64_t { kIdQ = 11, kIdK = 12, kIdV = 13, kIdG = 14, kIdBeta = 15, kIdState = 16, kIdDout = 17 };

// x -> offset + slope * x, in place (maps the uniform [-1, 1) inputs to the ranges g and beta need).
void affine_inplace(const TensorView& t, double offset, double slope) {
  dispatch_floating(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data_as<T>();
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const double x = offset + slope * static_cast<double>(to_float(p[i]));
      if constexpr (std::is_same_v<T, double>) {
        p[i] = x;
      } else {
        p[i] = from_float<T>(static_cast<float>(x));
      }
    }
  });
}

class GdnWorkload final : public Workload {
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
    switch (o_.dtype) {
      case DType::kFloat64: return {1e-12, 1e-10};
      case DType::kFloat32: return {1e-6, 1e-4};
      case DType::kBFloat16: return {1e-3, 2e-2};
      case DType::kFloat16: return {1e-4, 5e-3};
      default: break;
    }
    SEQPAR_THROW("sp_bench: no tolerance for dtype ", dtype_name(o_.dtype), " (", name, ")");
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = gdn_->layout().local_len();
    const std::vector<std::int64_t>& pos = gdn_->positions();
    q_ = Tensor::empty(qk_shape(local), o_.dtype, MemCategory::kSavedActivation);
    k_ = Tensor::empty(qk_shape(local), o_.dtype, MemCategory::kSavedActivation);
    v_ = Tensor::empty(qk_shape(local), o_.dtype, MemCategory::kSavedActivation);
    g_ = Tensor::empty(gate_shape(local), o_.dtype, MemCategory::kSavedActivation);
    beta_ = Tensor::empty(gate_shape(local), o_.dtype, MemCategory::kSavedActivation);
    state_ = Tensor::empty(state_shape(), state_dtype_, MemCategory::kModelState);
    dout_ = Tensor::empty(qk_shape(local), o_.dtype, MemCategory::kWorkspace);
    fill(full, pos, {q_.view(), k_.view(), v_.view(), g_.view(), beta_.view(), state_.view(), dout_.view()});
  }

  void release_outputs() override {
    out_ = GdnCpOutput{};
    grads_ = GdnCpGrads{};
  }

  PhaseCounters forward() override {
    out_ = GdnCpOutput{};
    gdn_->reset_counters();
    out_ = gdn_->forward(q_, k_, v_, g_, beta_, state_);
    return counters();
  }

  PhaseCounters backward() override {
    grads_ = GdnCpGrads{};
    gdn_->reset_counters();
    grads_ = gdn_->backward(std::move(out_.ctx), dout_);
    return counters();
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
    ref_in_.clear();
    ref_in_.emplace_back("q", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_in_.emplace_back("k", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_in_.emplace_back("v", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_in_.emplace_back("g", npy::HostArray(o_.dtype, gate_shape(o_.seq)));
    ref_in_.emplace_back("beta", npy::HostArray(o_.dtype, gate_shape(o_.seq)));
    ref_in_.emplace_back("initial_state", npy::HostArray(state_dtype_, state_shape()));
    ref_in_.emplace_back("dout", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    std::vector<std::int64_t> all(static_cast<std::size_t>(o_.seq));
    std::iota(all.begin(), all.end(), std::int64_t{0});
    std::vector<TensorView> views;
    for (auto& [name, a] : ref_in_) views.push_back(a.view());
    fill(full, all, views);
    ref_out_.clear();
    ref_out_.emplace_back("out", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_out_.emplace_back("final_state", npy::HostArray(state_dtype_, state_shape()));
    ref_out_.emplace_back("dq", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_out_.emplace_back("dk", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_out_.emplace_back("dv", npy::HostArray(o_.dtype, qk_shape(o_.seq)));
    ref_out_.emplace_back("dg", npy::HostArray(o_.dtype, gate_shape(o_.seq)));
    ref_out_.emplace_back("dbeta", npy::HostArray(o_.dtype, gate_shape(o_.seq)));
    ref_out_.emplace_back("dinitial_state", npy::HostArray(state_dtype_, state_shape()));
  }
  void reference_forward() override { attn::gdn_forward(ref_args(), ref("out"), ref("final_state")); }
  void reference_backward() override {
    attn::GdnBackwardArgs b;
    b.fwd = ref_args();
    b.dout = find_array(ref_in_, "dout").view();
    attn::gdn_backward(b, ref("dq"), ref("dk"), ref("dv"), ref("dg"), ref("dbeta"), ref("dinitial_state"));
  }
  NamedArrays reference_outputs() override { return ref_out_; }

  // --gdn-compare-token: the single-rank chunked kernel on the whole problem at the configured chunk size, and the
  // token-by-token recurrence run by the same kernel with chunk_size = 1 (same inputs, same dtype, same threads).
  std::vector<VariantTiming> time_variants(const NamedArrays* full, int warmup, int iters) override {
    if (!o_.gdn_compare_token) return {};
    if (ref_in_.empty()) reference_setup(full);
    std::vector<VariantTiming> r;
    for (const std::int64_t chunk : {o_.chunk_size, std::int64_t{1}}) {
      std::vector<double> f, b;
      for (int i = 0; i < warmup + iters; ++i) {
        const double t0 = seconds();
        attn::GdnForwardArgs a = ref_args();
        a.chunk_size = chunk;
        attn::gdn_forward(a, ref("out"), ref("final_state"));
        const double t1 = seconds();
        attn::GdnBackwardArgs bw;
        bw.fwd = a;
        bw.dout = find_array(ref_in_, "dout").view();
        attn::gdn_backward(bw, ref("dq"), ref("dk"), ref("dv"), ref("dg"), ref("dbeta"), ref("dinitial_state"));
        const double t2 = seconds();
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
    std::vector<std::int64_t> heads(static_cast<std::size_t>(o_.heads));
    std::iota(heads.begin(), heads.end(), std::int64_t{0});
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

  static double seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }

  attn::GdnForwardArgs ref_args() const {
    attn::GdnForwardArgs a;
    a.q = find_array(ref_in_, "q").view();
    a.k = find_array(ref_in_, "k").view();
    a.v = find_array(ref_in_, "v").view();
    a.g = find_array(ref_in_, "g").view();
    a.beta = find_array(ref_in_, "beta").view();
    a.initial_state = find_array(ref_in_, "initial_state").view();
    a.chunk_size = o_.chunk_size;
    return a;
  }

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

  PhaseCounters counters() const {
    const CpCounters& c = gdn_->counters();
    PhaseCounters p;
    p.exposed_comm_s = c.total_exposed_s();
    p.bytes_sent = c.total_bytes_sent();
    p.message_rounds = c.message_rounds;
    return p;
  }

  SpBenchOptions o_;
  const SpGrid& grid_;
  CpGroups groups_;
  DType state_dtype_;
  std::unique_ptr<GdnContextParallel> gdn_;
  Tensor q_, k_, v_, g_, beta_, state_, dout_;
  GdnCpOutput out_;
  GdnCpGrads grads_;
  NamedArrays ref_in_, ref_out_;
};

}  // namespace

std::vector<TensorSpec> gdn_input_specs(const SpBenchOptions& o) {
  const Shape qk{o.batch, o.seq, o.heads, o.head_dim}, gate{o.batch, o.seq, o.heads},
      state{o.batch, o.heads, o.head_dim, o.head_dim};
  return {{"q", qk}, {"k", qk}, {"v", qk}, {"g", gate}, {"beta", gate}, {"initial_state", state}, {"dout", qk}};
}

std::unique_ptr<Workload> make_gdn_workload(const SpBenchOptions& options, const SpGrid& grid) {
  return std::make_unique<GdnWorkload>(options, grid);
}

}  // namespace seqpar::bench
