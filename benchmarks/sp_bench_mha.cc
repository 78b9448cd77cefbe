#include "benchmarks/sp_bench_mha.h"

#include <numeric>

#include "attention/mha.h"
#include "parallel/layout.h"
#include "parallel/ring_attention.h"
#include "parallel/usp.h"
#include "runtime/error.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs (fixed: --inputs files and random inputs use the same names).
enum : std::uint64_t { kIdQ = 1, kIdK = 2, kIdV = 3, kIdDout = 4 };

class MhaWorkload final : public Workload {
 public:
  MhaWorkload(const SpBenchOptions& o, const SpGrid& grid)
      : o_(o),
        grid_(grid),
        groups_(CpGroups::from(grid)),
        layout_(SequenceLayout::for_groups(groups_, o.seq, o.layout)),
        positions_(layout_.positions(grid.coords().sp_rank)) {
    cfg_.impl = o.impl;
    cfg_.causal = o.causal;
    cfg_.window = o.window;
    usp_ = std::make_unique<UspAttention>(groups_, layout_, cfg_);
  }

  std::vector<TensorSpec> input_specs() const override { return mha_input_specs(o_); }
  std::vector<std::string> output_names() const override { return {"out", "lse", "dq", "dk", "dv"}; }

  double forward_flops() const override {
    double pairs = static_cast<double>(o_.seq) * static_cast<double>(o_.seq);
    if (o_.causal && o_.window == 0) {
      pairs /= 2;
    } else if (o_.causal) {
      std::vector<std::int64_t> pos(static_cast<std::size_t>(o_.seq));
      std::iota(pos.begin(), pos.end(), std::int64_t{0});
      pairs = static_cast<double>(attn::visible_pairs(pos, pos, {true, o_.window}));
    }
    return 4.0 * static_cast<double>(o_.batch * o_.heads * o_.head_dim) * pairs;
  }
  double backward_flops() const override { return 2.5 * forward_flops(); }

  Tolerance tolerance(const std::string& name) const override {
    // lse is fp32 for every storage dtype and differs only by the merge order of the blocks.
    if (name == "lse") return {1e-5, 1e-5};
    switch (o_.dtype) {
      // lse and the block merge weights are fp32 (DESIGN.md section 2), so fp64 results agree to fp32 precision.
      case DType::kFloat64: return {1e-9, 1e-5};
      case DType::kFloat32: return {1e-6, 1e-4};
      // 16-bit results are rounded once from fp32 accumulators: a different merge order moves them by about one
      // unit in the last place (2^-8 relative for bf16, 2^-11 for fp16).
      case DType::kBFloat16: return {1e-3, 2e-2};
      case DType::kFloat16: return {1e-4, 5e-3};
      default: break;
    }
    SEQPAR_THROW("sp_bench: no tolerance for dtype ", dtype_name(o_.dtype));
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = layout_.local_len();
    q_ = Tensor::empty(q_shape(local), o_.dtype, MemCategory::kSavedActivation);
    k_ = Tensor::empty(kv_shape(local), o_.dtype, MemCategory::kSavedActivation);
    v_ = Tensor::empty(kv_shape(local), o_.dtype, MemCategory::kSavedActivation);
    dout_ = Tensor::empty(q_shape(local), o_.dtype, MemCategory::kWorkspace);
    fill(full, positions_, {q_.view(), k_.view(), v_.view(), dout_.view()});
  }

  void release_outputs() override {
    out_ = AttentionOutput{};
    grads_ = AttentionGrads{};
  }

  PhaseCounters forward() override {
    out_ = AttentionOutput{};
    usp_->reset_counters();
    out_ = usp_->forward(q_, k_, v_);
    return from_usp(usp_->counters());
  }

  PhaseCounters backward() override {
    grads_ = AttentionGrads{};
    usp_->reset_counters();
    grads_ = usp_->backward(std::move(out_.ctx), dout_);
    return from_usp(usp_->counters());
  }

  NamedArrays gather_outputs() override {
    NamedArrays r;
    r.emplace_back("out", gather(out_.out, q_shape(o_.seq), 1));
    r.emplace_back("lse", gather(out_.lse, lse_shape(), 2));
    r.emplace_back("dq", gather(grads_.dq, q_shape(o_.seq), 1));
    r.emplace_back("dk", gather(grads_.dk, kv_shape(o_.seq), 1));
    r.emplace_back("dv", gather(grads_.dv, kv_shape(o_.seq), 1));
    return r;
  }

  void reference_setup(const NamedArrays* full) override {
    ref_q_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_k_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_v_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_dout_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    std::vector<std::int64_t> all(static_cast<std::size_t>(o_.seq));
    std::iota(all.begin(), all.end(), std::int64_t{0});
    fill(full, all, {ref_q_.view(), ref_k_.view(), ref_v_.view(), ref_dout_.view()});
    ref_out_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_lse_ = npy::HostArray(DType::kFloat32, lse_shape());
    ref_dq_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_dk_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_dv_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
  }
  void reference_forward() override { attn::mha_forward(ref_args(), ref_out_.view(), ref_lse_.view()); }
  void reference_backward() override {
    attn::MhaBackwardArgs b;
    b.fwd = ref_args();
    b.out = ref_out_.view();
    b.dout = ref_dout_.view();
    b.lse = ref_lse_.view();
    attn::mha_backward(b, ref_dq_.view(), ref_dk_.view(), ref_dv_.view(), /*accumulate=*/false);
  }
  NamedArrays reference_outputs() override {
    NamedArrays r;
    r.emplace_back("out", ref_out_);
    r.emplace_back("lse", ref_lse_);
    r.emplace_back("dq", ref_dq_);
    r.emplace_back("dk", ref_dk_);
    r.emplace_back("dv", ref_dv_);
    return r;
  }

 private:
  Shape q_shape(std::int64_t s) const { return {o_.batch, s, o_.heads, o_.head_dim}; }
  Shape kv_shape(std::int64_t s) const { return {o_.batch, s, o_.kv_heads, o_.head_dim}; }
  Shape lse_shape() const { return {o_.batch, o_.heads, o_.seq}; }

  // Fills q, k, v, dout at `positions`, from the loaded files or from the seed.
  void fill(const NamedArrays* full, const std::vector<std::int64_t>& positions, std::vector<TensorView> dst) const {
    const char* names[] = {"q", "k", "v", "dout"};
    const std::uint64_t ids[] = {kIdQ, kIdK, kIdV, kIdDout};
    for (int i = 0; i < 4; ++i) {
      if (full != nullptr) {
        shard_from_full(find_array(*full, names[i]), positions, dst[i]);
      } else {
        fill_random_shard(dst[i], o_.seed, ids[i], o_.seq, positions);
      }
    }
  }

  npy::HostArray gather(const Tensor& local, const Shape& full_shape, int seq_dim) const {
    npy::HostArray full(local.dtype(), full_shape);
    gather_sequence(grid_.sp(), layout_, local.view(), full.view(), seq_dim);
    return full;
  }

  attn::MhaForwardArgs ref_args() const {
    attn::MhaForwardArgs a;
    a.q = ref_q_.view();
    a.k = ref_k_.view();
    a.v = ref_v_.view();
    a.mask = {o_.causal, o_.window};
    return a;
  }

  static PhaseCounters from_usp(const CpCounters& c) {
    PhaseCounters p;
    p.exposed_comm_s = c.total_exposed_s();  // the all-to-alls are not overlapped with computation
    p.bytes_sent = c.total_bytes_sent();
    p.executed_flops = c.flops;
    return p;
  }

  SpBenchOptions o_;
  const SpGrid& grid_;
  CpGroups groups_;
  SequenceLayout layout_;
  std::vector<std::int64_t> positions_;
  RingAttentionConfig cfg_;
  std::unique_ptr<UspAttention> usp_;
  Tensor q_, k_, v_, dout_;
  AttentionOutput out_;
  AttentionGrads grads_;
  npy::HostArray ref_q_, ref_k_, ref_v_, ref_dout_, ref_out_, ref_lse_, ref_dq_, ref_dk_, ref_dv_;
};

}  // namespace

std::vector<TensorSpec> mha_input_specs(const SpBenchOptions& o) {
  const Shape q{o.batch, o.seq, o.heads, o.head_dim}, kv{o.batch, o.seq, o.kv_heads, o.head_dim};
  return {{"q", q}, {"k", kv}, {"v", kv}, {"dout", q}};
}

std::unique_ptr<Workload> make_mha_workload(const SpBenchOptions& options, const SpGrid& grid) {
  return std::make_unique<MhaWorkload>(options, grid);
}

}  // namespace seqpar::bench
