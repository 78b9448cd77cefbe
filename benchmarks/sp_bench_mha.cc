// sp_bench's MHA / GQA workload: ring, Ulysses and USP through MhaCp (ulysses-size 1 = pure ring,
// ring-size 1 = pure Ulysses). Inputs q k v dout [B, S, H, D]; outputs out [B, S, Hq, D], lse [B, Hq, S] (fp32;
// fp64 for fp64), dq, dk, dv. The reference is one attn::mha_forward + attn::mha_backward call on the full tensors; the
// fp64 reference of --check (sp_bench_check.h) is attn::reference::mha_forward / mha_backward. With --rope, q and k
// are rotated at their global positions before the layer and dq, dk get the transposed rotation after it
// (sp_bench_rope.h); the references do the same on positions 0..S-1 (the fp64 one with the fp64 RoPE reference).
// --dropout-seed S (MHA only) drop the same pairs in the layer, the one-rank kernel and the fp64 reference.
// Packed rows (--doc-lens, --doc-dist, cu_seqlens.npy; docs/design.md, "Packed rows and padding"): the layer runs on the packed
// layout (padding rows zero), RoPE uses the positions inside each document, and the references are one call over
// the whole row with the documents' bounds (attn::MaskSpec doc_lo / doc_hi): the single-rank packed result.
#include <algorithm>
#include <cmath>

#include "attention/mha.h"
#include "attention/reference/mha_reference.h"
#include "benchmarks/sp_bench_rope.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/layout.h"
#include "parallel/ring_attention.h"
#include "parallel/usp.h"
#include "runtime/error.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs (fixed: --inputs files and random inputs use the same names).
enum : std::uint64_t { kIdQ = 1, kIdK = 2, kIdV = 3, kIdDout = 4, kIdSinks = 5 };

// The score modifiers of the options: --softcap, --alibi (attn::alibi_slopes(heads)), --sinks (random logits in
// [-1, 3) per query head from the seed, fp64 for --dtype fp64 so that dsinks keeps fp64 precision, else fp32). The
// tensors own the values the returned ScoreMods views.
attn::ScoreMods score_mods(const SpBenchOptions& o, Tensor& slopes, Tensor& sinks) {
  attn::ScoreMods m;
  m.softcap = o.softcap;
  if (o.alibi) {
    const std::vector<float> s = attn::alibi_slopes(o.heads);
    slopes = Tensor::empty({o.heads}, DType::kFloat32, MemCategory::kWorkspace);
    std::copy(s.begin(), s.end(), slopes.view().data_as<float>());
    m.alibi_slopes = slopes.view();
  }
  if (o.sinks) {
    sinks = Tensor::empty({o.heads}, o.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32,
                          MemCategory::kWorkspace);
    for (std::int64_t h = 0; h < o.heads; ++h) {
      const float x = static_cast<float>(1.0 + 2.0 * random_uniform(o.seed, kIdSinks, static_cast<std::uint64_t>(h)));
      if (sinks.dtype() == DType::kFloat64) {
        sinks.view().data_as<double>()[h] = x;
      } else {
        sinks.view().data_as<float>()[h] = x;
      }
    }
    m.sinks = sinks.view();
  }
  return m;
}

// A copy of a [H] tensor (dsinks; on the device with --device cuda) as an output array.
npy::HostArray host_copy(const TensorView& t) {
  npy::HostArray a(t.dtype(), t.shape());
  if (t.device().is_cuda()) {
    copy_convert(t, a.view(), Stream{t.device(), nullptr});
    return a;
  }
  std::copy_n(static_cast<const char*>(t.data()), t.nbytes(), static_cast<char*>(a.view().data()));
  return a;
}

std::vector<TensorSpec> mha_input_specs(const SpBenchOptions& o);

class MhaWorkload final : public CpLayerWorkload<MhaCpOutput, MhaCpGrads> {
 public:
  MhaWorkload(const SpBenchOptions& o, const CpGrid& grid)
      : o_(o),
        grid_(grid),
        groups_(CpGroups::from(grid, compute_stream(o, grid))),
        layout_(sp_bench_layout(o)),
        tokens_(layout_.token_index(grid.coords().cp_rank)),
        rope_positions_(layout_.rope_positions(grid.coords().cp_rank)) {
    if (o.packed()) {
      const SequenceLayout one = SequenceLayout::packed(LayoutKind::kContiguous, layout_.cu_seqlens(), 1);
      ref_docs_ = one.doc_bounds(0);
      ref_rope_positions_ = one.rope_positions(0);
    }
    cfg_.impl = o.impl;
    cfg_.causal = o.causal;
    cfg_.window = o.window;
    cfg_.score_mods = score_mods(o, slopes_, sinks_);
    cfg_.dropout = {o.dropout, o.dropout_seed};
    usp_ = std::make_unique<MhaCp>(groups_, layout_, cfg_);
    if (o.rope) rope_ = {{"q", o.rope_cfg}, {"k", o.rope_cfg}};
  }

  std::vector<TensorSpec> input_specs() const override { return mha_input_specs(o_); }
  std::vector<std::string> output_names() const override {
    std::vector<std::string> names = {"out", "lse", "dq", "dk", "dv"};
    if (o_.sinks) names.push_back("dsinks");
    return names;
  }

  double forward_flops() const override {
    double pairs = static_cast<double>(o_.seq) * static_cast<double>(o_.seq);
    if (o_.causal && o_.window == 0 && !o_.packed()) {
      pairs /= 2;
    } else if (o_.causal || o_.packed()) {
      const std::vector<std::int64_t> pos = all_positions(o_.seq);
      pairs = static_cast<double>(attn::visible_pairs(pos, pos, ref_mask()));
    }
    return 4.0 * static_cast<double>(o_.batch * o_.heads * o_.head_dim) * pairs;
  }
  double backward_flops() const override { return 2.5 * forward_flops(); }

  Tolerance tolerance(const std::string& name) const override {
    // fp64 storage computes, merges and returns lse in fp64 (attention/mha.h); dsinks is fp64 then too.
    if (o_.dtype == DType::kFloat64) return kFp64Tolerance;
    // dsinks: a sum over all B S rows of fp32 terms, each from the rounded out of its row (delta = dout . out): the
    // storage dtype's rounding of out, which another merge order moves by one unit in the last place.
    if (name == "dsinks") return fp32_accumulator_tolerance(o_.dtype, name);
    // lse is fp32 for the other storage dtypes and differs only by the merge order of the blocks.
    if (name == "lse") return {1e-5, 1e-5};
    // The accumulators are fp32 (docs/design.md, "Conventions").
    return fp32_accumulator_tolerance(o_.dtype, name);
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = layout_.local_len();
    in_ = local_tensors(o_.dtype, {q_shape(local), kv_shape(local), kv_shape(local)});
    in_.push_back(Tensor::empty(q_shape(local), o_.dtype, MemCategory::kWorkspace));  // dout
    fill(full, tokens_, views_of(in_));
    // --device cuda: the layer reads device copies of the host inputs (made once, outside the timed loops)
    dev_in_.clear();
    if (groups_.stream.device.is_cuda()) {
      for (const Tensor& t : in_) {
        dev_in_.push_back(Tensor::empty(t.shape(), t.dtype(), MemCategory::kWorkspace, groups_.stream.device));
        copy_convert(t.view(), dev_in_.back().view(), groups_.stream);
      }
    }
  }

  NamedArrays gather_outputs() override {
    NamedArrays r;
    r.emplace_back("out", gather(out_.out, q_shape(o_.seq), 1));
    r.emplace_back("lse", gather(out_.lse, lse_shape(), 2));
    r.emplace_back("dq", gather(grads_.dq, q_shape(o_.seq), 1));
    r.emplace_back("dk", gather(grads_.dk, kv_shape(o_.seq), 1));
    r.emplace_back("dv", gather(grads_.dv, kv_shape(o_.seq), 1));
    if (o_.sinks) r.emplace_back("dsinks", host_copy(grads_.dsinks.view()));  // already the sum on every rank
    return r;
  }

  NamedArrays make_full_inputs() const override {
    NamedArrays r;
    for (const TensorSpec& t : mha_input_specs(o_)) r.emplace_back(t.name, npy::HostArray(o_.dtype, t.shape));
    fill(nullptr, all_positions(o_.seq), views_of(r));
    return r;
  }

  void reference_setup(const NamedArrays* full) override {
    ref_q_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_k_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_v_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_dout_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    fill(full, all_positions(o_.seq), {ref_q_.view(), ref_k_.view(), ref_v_.view(), ref_dout_.view()});
    ref_rq_ = ref_q_;
    ref_rk_ = ref_k_;
    if (o_.rope) {
      rope_host(o_.rope_cfg, ref_rq_, /*backward=*/false, false, ref_rope_positions_);
      rope_host(o_.rope_cfg, ref_rk_, /*backward=*/false, false, ref_rope_positions_);
    }
    ref_out_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_lse_ = npy::HostArray(accumulator_dtype(o_.dtype), lse_shape());
    ref_dq_ = npy::HostArray(o_.dtype, q_shape(o_.seq));
    ref_dk_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    ref_dv_ = npy::HostArray(o_.dtype, kv_shape(o_.seq));
    if (o_.sinks) ref_dsinks_ = npy::HostArray(sinks_.dtype(), sinks_.shape());
  }
  void reference_forward() override { attn::mha_forward(ref_args(), ref_out_.view(), ref_lse_.view()); }
  void reference_backward() override {
    attn::MhaBackwardArgs b;
    b.fwd = ref_args();
    b.out = ref_out_.view();
    b.dout = ref_dout_.view();
    b.lse = ref_lse_.view();
    attn::mha_backward(b, ref_dq_.view(), ref_dk_.view(), ref_dv_.view(), /*accumulate=*/false);
    if (o_.rope) {
      rope_host(o_.rope_cfg, ref_dq_, /*backward=*/true, false, ref_rope_positions_);
      rope_host(o_.rope_cfg, ref_dk_, /*backward=*/true, false, ref_rope_positions_);
    }
    if (o_.sinks) {
      npy::HostArray delta(ref_lse_.dtype, lse_shape());
      attn::mha_backward_delta(ref_out_.view(), ref_dout_.view(), delta.view());
      attn::mha_sinks_backward({delta.view(), ref_lse_.view(), sinks_.view()}, ref_dsinks_.view());
    }
  }
  NamedArrays reference_outputs() override {
    NamedArrays r;
    r.emplace_back("out", ref_out_);
    r.emplace_back("lse", ref_lse_);
    r.emplace_back("dq", ref_dq_);
    r.emplace_back("dk", ref_dk_);
    r.emplace_back("dv", ref_dv_);
    if (o_.sinks) r.emplace_back("dsinks", ref_dsinks_);
    return r;
  }

  NamedArrays fp64_reference_outputs() override {
    // 16-bit storage: the kernel reads the rotated copies rounded to the storage dtype, and the logits of
    // fp64-rotated q and k would differ from its by that rounding (a 16-bit error in the fp32 lse): the reference
    // attends to the kernel's operands, ref_rq_ and ref_rk_. The rotation itself is checked against the fp64 RoPE
    // reference in fp32 and fp64.
    const bool rounded = o_.dtype == DType::kBFloat16 || o_.dtype == DType::kFloat16;
    NamedArrays in = widen_to_fp64(NamedArrays{
        {"q", rounded ? ref_rq_ : ref_q_}, {"k", rounded ? ref_rk_ : ref_k_}, {"v", ref_v_}, {"dout", ref_dout_}});
    if (!rounded) rope_named(rope_, in, /*backward=*/false, /*fp64_reference=*/true, ref_rope_positions_);
    const DType f64 = DType::kFloat64;
    NamedArrays r = zero_arrays({{"out", f64, q_shape(o_.seq)},
                                 {"lse", f64, lse_shape()},
                                 {"dq", f64, q_shape(o_.seq)},
                                 {"dk", f64, kv_shape(o_.seq)},
                                 {"dv", f64, kv_shape(o_.seq)}});
    if (o_.sinks) r.emplace_back("dsinks", npy::HostArray(f64, {o_.heads}));
    attn::MhaForwardArgs a;
    a.q = find_array(in, "q").view();
    a.k = find_array(in, "k").view();
    a.v = find_array(in, "v").view();
    a.mask = ref_mask();
    a.mods = cfg_.score_mods;
    a.dropout = cfg_.dropout;
    const std::vector<TensorView> v = views_of(r);
    attn::reference::mha_forward(a, v[0], v[1]);
    attn::reference::mha_backward(a, find_array(in, "dout").view(), v[2], v[3], v[4], o_.sinks ? v[5] : TensorView{});
    rope_named(rope_, r, /*backward=*/true, /*fp64_reference=*/true, ref_rope_positions_);
    if (rounded) set_rounding_floors(in, r[0].second);
    return r;
  }

  double rounding_floor(const std::string& name) const override {
    return name == "dq" ? floor_dq_ : name == "dk" ? floor_dk_ : 0.0;
  }

 private:
  Shape q_shape(std::int64_t s) const { return {o_.batch, s, o_.heads, o_.head_dim}; }
  Shape kv_shape(std::int64_t s) const { return {o_.batch, s, o_.kv_heads, o_.head_dim}; }
  Shape lse_shape() const { return {o_.batch, o_.heads, o_.seq}; }

  // The rounding floors of dq and dk in 16-bit storage: the backward subtracts delta_i = sum_d dout_id out_id, with
  // out rounded to the storage dtype (unit u), from dP_ij; the rounding moves delta_i by up to u sum_d |dout_id
  // out_id|, which reaches dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j times scale max|k| (sum_j P_ij = 1), and
  // dk_j likewise times scale max|q| (per unit of attention weight its column receives). Where the terms cancel
  // (one-token documents: exact dq = dk = 0) that is the whole error.
  void set_rounding_floors(const NamedArrays& in, const npy::HostArray& out) {
    const double u = o_.dtype == DType::kFloat16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    const double scale = cfg_.scale > 0 ? cfg_.scale : 1.0 / std::sqrt(static_cast<double>(o_.head_dim));
    auto max_abs = [](const npy::HostArray& a) {
      const double* p = a.view().data_as<double>();
      double m = 0;
      for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(p[i]));
      return m;
    };
    const double* dout = find_array(in, "dout").view().data_as<double>();
    const double* o = out.view().data_as<double>();
    double delta_terms = 0;  // max over rows (b, s, h) of sum_d |dout out|
    for (std::int64_t row = 0; row < out.numel() / o_.head_dim; ++row) {
      double t = 0;
      for (std::int64_t d = 0; d < o_.head_dim; ++d)
        t += std::abs(dout[row * o_.head_dim + d] * o[row * o_.head_dim + d]);
      delta_terms = std::max(delta_terms, t);
    }
    floor_dq_ = u * scale * delta_terms * max_abs(find_array(in, "k"));
    floor_dk_ = u * scale * delta_terms * max_abs(find_array(in, "q"));
  }

  // The references' mask: the options' plus, for a packed row, each token's document (slots = tokens on one rank).
  attn::MaskSpec ref_mask() const { return {o_.causal, o_.window, ref_docs_.lo, ref_docs_.hi}; }

  // Fills q, k, v, dout at the token indices `positions` (-1: a padding row, zeros), from the loaded files or from
  // the seed.
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
    if (o_.test_logit_scale != 1) affine_inplace(dst[0], 0.0, o_.test_logit_scale);
  }

  // The whole tensor on every rank from each rank's rows; a device tensor is copied to the host first.
  npy::HostArray gather(const Tensor& local, const Shape& full_shape, int seq_dim) const {
    npy::HostArray full(local.dtype(), full_shape);
    Tensor host;
    if (local.view().device().is_cuda()) {
      host = Tensor::empty(local.shape(), local.dtype(), MemCategory::kWorkspace);
      copy_convert(local.view(), host.view(), groups_.stream);
    }
    gather_sequence(grid_.cp(), layout_, host.defined() ? host.view() : local.view(), full.view(), seq_dim);
    return full;
  }

  // The stream of the layer's kernels: --device cuda's default stream (with --backend nccl, the GPU of the rank's
  // communicator), or the host.
  static Stream compute_stream(const SpBenchOptions& o, const CpGrid& grid) {
    if (o.device.is_cpu()) return Stream::cpu();
    const Device d = grid.cp().device().is_cuda() ? grid.cp().device() : o.device;
    return Stream{d, nullptr};
  }
  // Input i as the layer takes it: the device copy with --device cuda, else the host tensor.
  const TensorView& input(int i) const { return dev_in_.empty() ? in_[i].view() : dev_in_[i].view(); }

  attn::MhaForwardArgs ref_args() const {
    attn::MhaForwardArgs a;
    a.q = ref_rq_.view();
    a.k = ref_rk_.view();
    a.v = ref_v_.view();
    a.mask = ref_mask();
    a.mods = cfg_.score_mods;
    a.dropout = cfg_.dropout;
    return a;
  }

  void reset_layer_counters() override { usp_->reset_counters(); }
  // With RoPE the layer sees rotated copies of q and k (held until the next forward).
  MhaCpOutput run_forward() override {
    if (rope_.empty()) return usp_->forward(input(kQ), input(kK), input(kV));
    // --device cuda: the device copies rotated on the device (attention/rope.h)
    rotated_ = rope_rotated_copies(rope_, {input(kQ), input(kK)}, rope_positions_, groups_.stream);
    return usp_->forward(rotated_[0], rotated_[1], input(kV));
  }
  MhaCpGrads run_backward(CpContext&& ctx) override {
    MhaCpGrads g = usp_->backward(std::move(ctx), input(kDout));
    rope_backward_all(rope_, {g.dq.view(), g.dk.view()}, rope_positions_);
    return g;
  }
  PhaseCounters forward_counters() override { return phase_counters_with_rounds(usp_->counters()); }
  PhaseCounters backward_counters() override { return phase_counters_with_rounds(usp_->counters()); }

  SpBenchOptions o_;
  const CpGrid& grid_;
  CpGroups groups_;
  SequenceLayout layout_;
  std::vector<std::int64_t> tokens_;              // this rank's token per local row (-1: padding)
  std::vector<std::int64_t> rope_positions_;      // this rank's RoPE positions (inside each document)
  DocBounds ref_docs_;                            // packed: each token's document bounds for the references
  std::vector<std::int64_t> ref_rope_positions_;  // packed: the references' RoPE positions (empty: 0..S-1)
  MhaCpConfig cfg_;
  Tensor slopes_, sinks_;  // what cfg_.score_mods views (--alibi, --sinks)
  std::unique_ptr<MhaCp> usp_;
  enum Input { kQ, kK, kV, kDout };
  std::vector<Tensor> in_;        // this rank's q, k, v, dout
  std::vector<Tensor> dev_in_;    // their copies on the device (--device cuda), else empty
  std::vector<RopeTarget> rope_;  // q and k with --rope; empty without
  std::vector<Tensor> rotated_;   // the rotated q, k of the last forward
  npy::HostArray ref_q_, ref_k_, ref_v_, ref_dout_, ref_out_, ref_lse_, ref_dq_, ref_dk_, ref_dv_, ref_dsinks_;
  double floor_dq_ = 0, floor_dk_ = 0;  // set_rounding_floors
  npy::HostArray ref_rq_, ref_rk_;      // the reference's q, k after RoPE (copies of ref_q_, ref_k_ without it)
};

std::vector<TensorSpec> mha_input_specs(const SpBenchOptions& o) {
  const Shape q{o.batch, o.seq, o.heads, o.head_dim}, kv{o.batch, o.seq, o.kv_heads, o.head_dim};
  return {{"q", q}, {"k", kv}, {"v", kv}, {"dout", q}};
}

// attn::reference: the [Sq, Sk] scores and probabilities of one (b, h) at a time, the inputs and outputs in fp64
// (outputs and gradients are as large as the inputs); forward and backward each about 4 B Hq S^2 D multiply-adds over
// all pairs (the mask is evaluated, not skipped).
Fp64ReferenceCost mha_reference_cost(const SpBenchOptions& o) {
  const double s = static_cast<double>(o.seq);
  return {8.0 * (2.0 * spec_elements(mha_input_specs(o)) + 3.0 * s * s),
          2 * 8.0 * static_cast<double>(o.batch * o.heads * o.head_dim) * s * s};
}

// What MhaWorkload's step holds on one rank (sp_bench_memory.h), following MhaCp and RingAttention
// (parallel/usp.cc, ring_attention.cc, ring_pass.cc): per rank q [B, S/P, Hq, D] and, after the Ulysses exchange, kv
// with hx heads (Hkv, or Pu when Pu > Hkv replicates them) over the ring shard; accumulators fp32. S is the layout's
// padded length (every padding row is allocated like a token); the host arrays of the whole problem hold o.seq rows.
WorkloadMemory mha_memory(const SpBenchOptions& o) {
  // f: the accumulator dtype (out, lse, dq / dk / dv sums): fp64 for fp64, else fp32.
  const double e = static_cast<double>(dtype_size(o.dtype)), f = o.dtype == DType::kFloat64 ? 8 : 4;
  const double pu = o.grid.ulysses_size, pr = o.grid.ring_size;
  const double s_pad = static_cast<double>(sp_bench_padded_len(o)), unpad = static_cast<double>(o.seq) / s_pad;
  const double sl = s_pad / (pu * pr), bsd = static_cast<double>(o.batch) * sl * o.head_dim;
  const bool replicate = o.kv_heads % o.grid.ulysses_size != 0;
  const double hx = replicate ? pu : static_cast<double>(o.kv_heads);
  const double q = bsd * o.heads, kv_in = bsd * o.kv_heads, kv = bsd * hx;  // elements per rank
  const double lse = f * static_cast<double>(o.batch) * o.heads * sl;       // bytes
  const double a2a = pu > 1 ? 2 * e * q : 0;                                // send + receive of one exchange
  const double kv_grad = replicate ? f : e;
  // The kernels' scratch on one block (attention/cpu/mha_*_cpu.cc): Sq = S / Pr query rows against Sk keys (one
  // ring shard, or the whole sequence for allgather), in the compute type (fp64 for fp64, else fp32), 64 x 64
  // tiles, D padded to the vector width (16 is enough), per-thread buffers for every thread.
  const double c = o.dtype == DType::kFloat64 ? 8 : 4, threads = o.threads, batch = static_cast<double>(o.batch);
  const double sq = s_pad / pr, sk = o.impl == RingImpl::kP2P ? sq : s_pad;
  const double dp = std::ceil(o.head_dim / 16.0) * 16, nkt = std::ceil(sk / 64), skp = 64 * nkt;
  const double hq_local = o.heads / pu, hkv_local = hx / pu;
  const double nchunks = std::clamp(std::ceil(8 / (batch * hq_local)), 1.0, nkt);
  // The forward's task takes hc query heads of a KV group (up to 8, a divisor of the group); the backward sums dK / dV
  // pairwise over the nqt query tiles (levels + 1 partial tiles each).
  double hc = std::min(8.0, std::max(1.0, std::floor(hq_local / std::max(1.0, hkv_local))));
  while (hc > 1 && std::fmod(std::floor(hq_local / std::max(1.0, hkv_local)), hc) != 0) --hc;
  const double nqt = std::ceil(sq / 64), levels = 1 + std::ceil(std::log2(std::max(1.0, nqt)));
  const double fwd_kernel =
      c * (2 * batch * hkv_local * skp * dp +
           threads * (o.head_dim + hc * 2 * 64 * dp + 64 * 64 + hc * 128 + dp + o.head_dim * 64));
  const double bwd_kernel =
      c * (batch * hq_local * skp * dp * 2 + (nchunks > 1 ? nchunks * batch * hq_local * sq * dp : 0) +
           threads * (3 * sq * dp + 2 * sq + skp * dp + 2 * nkt * o.head_dim * 64 + 2 * 64 * 64 + 2 * dp +
                      2 * (levels + 1) * 64 * dp));
  WorkloadMemory m;
  m.inputs = e * (2 * q + 2 * kv_in);               // q, k, v, dout
  const double saved = e * (2 * q + 2 * kv) + lse;  // the ring's copies of q, k, v, out, and lse
  // Forward: q_h k_h v_h (and replicated kv), out_h lse_h (Pu > 1), the fp32 accumulator and block result; the ring's
  // kv double buffer (p2p) or the gathered kv (allgather); the outputs out and lse.
  m.forward.saved = saved;
  m.forward.outputs = e * q + lse;
  const double rope = o.rope ? e * (q + kv_in) : 0;  // the rotated copies of q and k (held through the backward)
  // Pu = 1 moves nothing: the ring reads q, k, v and writes out, lse, dq, dk, dv in place (no _h tensors).
  const double heads_side = pu > 1 ? 1 : 0;
  m.forward.workspace =
      heads_side * (e * (2 * q + 2 * kv) + (replicate ? 2 * e * kv : 0) + lse) + 2 * f * q + lse + fwd_kernel + rope;
  const double gather = e * kv * (4 * pr + 2);
  m.forward.comm = (o.impl == RingImpl::kP2P ? 6 * e * kv : gather) + a2a;
  // Backward: the forward's out and lse stay held; dout_h, dq_h dk_h dv_h (Pu > 1), delta, the fp32 dq accumulator and
  // dk dv (p2p: one ring shard; allgather: the whole sequence); the circulating kv and gradient buffers.
  m.backward.saved = saved;
  m.backward.outputs = e * q + lse + e * (q + 2 * kv_in);
  m.backward.workspace = heads_side * (2 * e * q + 2 * kv_grad * kv + (replicate ? 2 * f * kv : 0)) + lse + f * q +
                         (o.impl == RingImpl::kP2P ? 2 * f * kv : 2 * f * kv * pr) + bwd_kernel + rope;
  const double ring_p2p = e * 6 * kv + f * 2 * kv * (pr > 1 ? 4 : 2);
  const double ring_ag = std::max(gather, 2 * e * kv * pr + f * 2 * kv * (pr + 1));
  m.backward.comm = (o.impl == RingImpl::kP2P ? ring_p2p : ring_ag) + a2a;
  m.full_inputs = m.inputs * pu * pr * unpad;  // the whole sequence: the local shard times P, less the padding
  m.full_outputs = (e * (2 * q + 2 * kv_in) + e * q + lse) * pu * pr * unpad;  // out, lse, dq, dk, dv
  m.reference_scratch = o.rope ? m.full_inputs / 2 : 0;  // the reference's rotated q and k (at most half the inputs)
  return m;
}

SEQPAR_WORKLOAD_KIND(MhaWorkload) {
  WorkloadKind k;
  k.name = "mha";
  k.description = "MHA/GQA (ring, Ulysses, USP)";
  // Llama 3.1 8B (config.json): rope_theta 500000, rope_scaling llama3 (factor 8, low 1, high 4, original 8192).
  attn::RopeConfig llama3_rope;
  llama3_rope.theta = 500000;
  llama3_rope.scaling = attn::RopeScaling::kLlama3;
  // Qwen3-Next-80B-A3B's full-attention layers (config.json): 16 q heads, 2 kv heads, head dim 256,
  // partial_rotary_factor 0.25 (64 of 256 columns, rotate-half), rope_theta 1e7; the output gate is not modelled.
  attn::RopeConfig qwen_rope;
  qwen_rope.rotary_dim = 64;
  qwen_rope.theta = 1e7;
  // gpt-oss-20b (config.json): rope_theta 150000, rope_scaling yarn (factor 32, original 4096, beta_fast 32,
  // beta_slow 1); learned sinks per head.
  attn::RopeConfig gpt_oss_rope;
  gpt_oss_rope.theta = 150000;
  gpt_oss_rope.scaling = attn::RopeScaling::kYarn;
  gpt_oss_rope.yarn.factor = 32;
  k.presets = {{"llama3-8b", 32, 8, 128, 0, 0, 0, 0, 0,
                "MHA/GQA: 32 query heads, 8 kv heads, head dim 128, causal, RoPE theta 500000 with llama3 scaling "
                "(factor 8)",
                0, llama3_rope},
               {"qwen3-next-attn", 16, 2, 256, 0, 0, 0, 0, 0,
                "MHA/GQA: Qwen3-Next's attention layers, 16 query heads, 2 kv heads, head dim 256, causal, partial "
                "RoPE (64 columns) theta 1e7",
                0, qwen_rope},
               {"gemma2-9b", 16, 8, 256, 0, 0, 0, 0, 0,
                "MHA/GQA: 16 query heads, 8 kv heads, head dim 256, logit soft-capping 50, causal, RoPE theta 10000", 0,
                attn::RopeConfig{}, 50.0},
               {"gpt-oss-20b", 64, 8, 64, 0, 0, 0, 0, 0,
                "MHA/GQA: 64 query heads, 8 kv heads, head dim 64, learned attention sinks, causal, RoPE theta "
                "150000 with YaRN (factor 32)",
                0, gpt_oss_rope, 0.0, true}};
  k.own_flags = {"test-logit-scale", "impl",        "window", "kv-heads", "softcap", "alibi", "sinks",
                 "dropout",          "dropout-seed"};
  for (const std::string& f : rope_flags()) k.own_flags.push_back(f);
  k.add_json = add_rope_json;
  k.input_shape_flags = {{"batch", "q", 0, &SpBenchOptions::batch},
                         {"seq", "q", 1, &SpBenchOptions::seq},
                         {"heads", "q", 2, &SpBenchOptions::heads},
                         {"head-dim", "q", 3, &SpBenchOptions::head_dim},
                         {"kv-heads", "k", 2, &SpBenchOptions::kv_heads}};
  k.input_specs = mha_input_specs;
  k.estimate_memory = mha_memory;
  k.fp64_reference_cost = mha_reference_cost;
  k.validate = [](SpBenchOptions& o) {
    SEQPAR_CHECK(o.heads % o.kv_heads == 0, "--heads ", o.heads, preset_note(o, "heads"),
                 " must be a multiple of --kv-heads ", o.kv_heads, preset_note(o, "kv-heads"), " (GQA)");
    const int pu = o.grid.ulysses_size;
    SEQPAR_CHECK(o.heads % pu == 0, "--heads ", o.heads, preset_note(o, "heads"),
                 " must be divisible by --ulysses-size ", pu);
    SEQPAR_CHECK(o.kv_heads % pu == 0 || pu % o.kv_heads == 0, "--kv-heads ", o.kv_heads, preset_note(o, "kv-heads"),
                 " must divide or be a multiple of --ulysses-size ", pu, " (--heads ", o.heads, ")");
    SEQPAR_CHECK(std::isfinite(o.softcap) && o.softcap >= 0, "--softcap ", o.softcap,
                 " must be finite and > 0 (0: no soft-capping)");
    attn::DropoutSpec{o.dropout, o.dropout_seed}.validate("--dropout");
    SEQPAR_CHECK(std::isfinite(o.test_logit_scale) && o.test_logit_scale > 0, "--test-logit-scale ", o.test_logit_scale,
                 " must be a finite number > 0");
    SEQPAR_CHECK(o.test_logit_scale == 1 || o.inputs_dir.empty(),
                 "--test-logit-scale scales the random q; it cannot be combined with --inputs");
    if (o.rope) {
      check_rope_fits(o.rope_cfg, o.head_dim, "--head-dim", preset_note(o, "rope-dim"), preset_note(o, "head-dim"));
    }
  };
  k.describe_shapes = [](const SpBenchOptions& o) {
    std::string s = str_cat("B=", o.batch, " S=", o.seq, " Hq=", o.heads, " Hkv=", o.kv_heads, " D=", o.head_dim,
                            " causal=", o.causal ? "yes" : "no");
    if (o.packed()) s += str_cat(" docs=", o.doc_lens.size());
    if (o.window > 0) s += str_cat(" window=", o.window);
    if (o.rope) s += " " + describe_rope(o, o.rope_cfg);
    if (o.softcap > 0) s += str_cat(" softcap=", o.softcap);
    if (o.alibi) s += " alibi";
    if (o.sinks) s += " sinks";
    if (o.dropout > 0) s += str_cat(" dropout=", o.dropout, " seed=", o.dropout_seed);
    return s;
  };
  return k;
}

}  // namespace

// MHA's own flags of `group` (sp_bench --help order; the registry: add_sp_bench_flags in sp_bench_options.cc).
void add_mha_flags(cxxopts::Options& spec, FlagGroup group) {
  // clang-format off
  if (group == FlagGroup::kProblem) {
    spec.add_options("problem")
      ("softcap", "MHA: logit soft-capping, scores -> X tanh(scores / X) (Gemma 2; 0: none)",
       cxxopts::value<double>()->default_value("0"))
      ("alibi", "MHA: ALiBi position biases on global positions (slopes of Press et al. 2022)")
      ("sinks", "MHA: learned attention sinks, one random logit per query head (gpt-oss); output dsinks")
      ("dropout", "MHA: dropout probability p of the attention probabilities, in [0, 1) (0: none)",
       cxxopts::value<std::string>()->default_value("0"))
      ("dropout-seed", "MHA: seed of the dropout mask (Philox key; the mask is the same on every grid and layout)",
       cxxopts::value<std::uint64_t>()->default_value("0"));
  } else if (group == FlagGroup::kParallel) {
    spec.add_options("parallel")
      ("impl", "ring implementation: p2p | allgather", cxxopts::value<std::string>()->default_value("p2p"));
  }
  // clang-format on
}

}  // namespace seqpar::bench
