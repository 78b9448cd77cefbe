// sp_bench's DSA (DeepSeek sparse attention) workload: indexer top-k selection over the CP group (ring or
// all-gather), sparse latent attention over the ring, heads over the Ulysses group, and the indexer KL loss, through
// DsaCp (parallel/dsa_cp.h). Inputs q [B, S, H, Dqk], c [B, S, Dqk], q_idx [B, S, Hi, Di],
// k_idx [B, S, Di], w [B, S, Hi], dout [B, S, H, Dv] (Dqk = --head-dim, Dv = --dim-v, Hi = --indexer-heads,
// Di = --indexer-dim); outputs out [B, S, H, Dv], lse [B, H, S] fp32, topk_indices [B, S, k] int64, loss [1] fp64,
// dq, dc, dq_idx, dk_idx, dw. The reference is the single-device kernels (attention/dsa.h) on the whole sequence,
// one call each; the fp64 reference of --check (sp_bench_check.h) is attn::reference on the one-rank kernel's
// topk_indices. lse and the kernels' accumulators are fp64 for fp64 inputs. With --rope (the deepseek-v3.2 preset:
// interleaved, 64 columns, YaRN factor 40), as DeepSeek-V3.2 does: the last --rope-dim columns of q and of the latent
// c rotate with --rope's pairing, the first --rope-dim columns of the indexer's q_idx and k_idx rotate-half (the
// indexer's layout in DeepSeek's fixed inference code), all at the global positions and before the layer; the
// gradients get the transposed rotations after it; YaRN's mscale_all_dim multiplies the attention's softmax scale by
// mscale^2 (attn::rope_softmax_scale_factor).
// Packed rows (--doc-lens, --doc-dist, cu_seqlens.npy) and lengths that need padding (docs/design.md, "DSA on packed rows"):
// the layer runs on sp_bench_layout (padding rows zero, RoPE at the positions inside each document), its topk_indices
// (slot positions) are mapped to token indices before they are gathered, and the references are one call over the
// whole row with the documents' bounds (attn::DsaIndexerArgs doc_lo / doc_hi): the single-rank packed result.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "attention/dsa.h"
#include "attention/reference/dsa_reference.h"
#include "benchmarks/flop_models.h"
#include "benchmarks/sp_bench_rope.h"
#include "benchmarks/sp_bench_workload.h"
#include "parallel/dsa_cp.h"
#include "parallel/layout.h"
#include "runtime/error.h"

namespace seqpar::bench {
namespace {

// Random-stream ids of the inputs.
enum : std::uint64_t { kIdQ = 21, kIdC = 22, kIdQIdx = 23, kIdKIdx = 24, kIdW = 25, kIdDout = 26 };

constexpr int kNumInputs = 6;
constexpr const char* kInputNames[kNumInputs] = {"q", "c", "q_idx", "k_idx", "w", "dout"};

std::vector<TensorSpec> dsa_input_specs(const SpBenchOptions& o);

// The rotated inputs (none without --rope): q and the latent c on their last r columns with --rope's pairing, the
// indexer's q_idx and k_idx on their first r columns, rotate-half.
std::vector<RopeTarget> dsa_rope_targets(const SpBenchOptions& o) {
  if (!o.rope) return {};
  attn::RopeConfig latent = o.rope_cfg, indexer = o.rope_cfg;
  latent.column_offset = o.head_dim - o.rope_cfg.rotary_dim;
  indexer.pairing = attn::RopePairing::kRotateHalf;
  indexer.column_offset = 0;
  return {{"q", latent}, {"c", latent}, {"q_idx", indexer}, {"k_idx", indexer}};
}

// The attention's softmax scale: 1 / sqrt(Dqk), times YaRN's mscale^2 where the RoPE has one (DeepSeek-V3).
double dsa_softmax_scale(const SpBenchOptions& o) {
  const double factor = o.rope ? attn::rope_softmax_scale_factor(o.rope_cfg) : 1.0;
  return factor == 1.0 ? 0.0 : factor / std::sqrt(static_cast<double>(o.head_dim));
}

// Model FLOPs (benchmarks/flop_models.h, docs/benchmarks.md, "Definitions of the benchmark figures") of the options' shapes.
DsaFlopShape dsa_flop_shape(const SpBenchOptions& o) {
  return {o.batch,         o.seq,         o.heads, o.head_dim, o.dim_v,
          o.indexer_heads, o.indexer_dim, o.topk,  o.window,   o.packed() ? o.doc_lens : std::vector<std::int64_t>{}};
}
double attention_flops_per_pair(const SpBenchOptions& o) { return dsa_attention_flops_per_pair(dsa_flop_shape(o)); }
double indexer_flops_per_pair(const SpBenchOptions& o) { return dsa_indexer_flops_per_pair(dsa_flop_shape(o)); }

class DsaWorkload final : public CpLayerWorkload<DsaCpOutput, DsaCpGrads> {
 public:
  DsaWorkload(const SpBenchOptions& o, const CpGrid& grid)
      : o_(o), grid_(grid), groups_(CpGroups::from(grid)), rope_(dsa_rope_targets(o)) {
    const SequenceLayout layout = sp_bench_layout(o);
    tokens_ = layout.token_index(grid.coords().cp_rank);
    rope_positions_ = layout.rope_positions(grid.coords().cp_rank);
    if (o.packed()) {
      const SequenceLayout one = SequenceLayout::packed(LayoutKind::kContiguous, layout.cu_seqlens(), 1);
      ref_docs_ = one.doc_bounds(0);
      ref_rope_positions_ = one.rope_positions(0);
    }
    DsaCpConfig cfg;
    cfg.select = parse_dsa_select_mode(o.dsa_select);
    cfg.topk = o.topk;
    cfg.dim_v = o.dim_v;
    cfg.scale = dsa_softmax_scale(o);
    cfg.window = o.window;
    dsa_ = std::make_unique<DsaCp>(groups_, layout, cfg);
  }

  std::vector<TensorSpec> input_specs() const override { return dsa_input_specs(o_); }
  std::vector<std::string> output_names() const override {
    return {"out", "lse", "topk_indices", "loss", "dq", "dc", "dq_idx", "dk_idx", "dw"};
  }

  double forward_flops() const override { return dsa_forward_flops(dsa_flop_shape(o_)); }
  double backward_flops() const override { return dsa_backward_flops(dsa_flop_shape(o_)); }

  Tolerance tolerance(const std::string& name) const override {
    // The selection is a strict total order on (score, position), independent of how the keys are split.
    if (name == "topk_indices") return {0, 0};
    // fp64 storage is fp64 end to end (scores, accumulators, lse, loss terms; attention/dsa.h).
    if (o_.dtype == DType::kFloat64) return kFp64Tolerance;
    // lse (fp32) differs only by the merge order of the latent blocks.
    if (name == "lse") return {1e-5, 1e-5};
    // The loss is an fp64 sum of per-row fp32 terms; under Ulysses the head-summed probabilities are reduced over
    // the group in another order, which moves each row's p* by fp32 rounding.
    if (name == "loss") return {1e-6, 1e-5};
    // Every accumulator that crosses blocks (out, lse, dq, dc, dq_idx, dk_idx, dw) is fp32 (attention/dsa.h).
    return fp32_accumulator_tolerance(o_.dtype, name);
  }

  void setup(const NamedArrays* full) override {
    const std::int64_t local = dsa_->layout().local_len();
    const DType t = o_.dtype;
    in_ = local_tensors(t, {q_shape(local), c_shape(local), q_idx_shape(local), k_idx_shape(local), w_shape(local)});
    in_.push_back(Tensor::empty(out_shape(local), t, MemCategory::kWorkspace));  // dout
    fill(full, tokens_, views_of(in_));
  }

  NamedArrays gather_outputs() override {
    NamedArrays r;
    r.emplace_back("out", gather(out_.out, out_shape(o_.seq), 1));
    r.emplace_back("lse", gather(out_.lse, lse_shape(), 2));
    dsa_topk_slots_to_tokens(dsa_->layout(), out_.topk_indices.view());  // the same where nothing is padded
    r.emplace_back("topk_indices", gather(out_.topk_indices, topk_shape(), 1));
    npy::HostArray loss(DType::kFloat64, {1});
    reinterpret_cast<double*>(loss.bytes.data())[0] = grads_.loss;
    r.emplace_back("loss", std::move(loss));
    r.emplace_back("dq", gather(grads_.dq, q_shape(o_.seq), 1));
    r.emplace_back("dc", gather(grads_.dc, c_shape(o_.seq), 1));
    r.emplace_back("dq_idx", gather(grads_.dq_idx, q_idx_shape(o_.seq), 1));
    r.emplace_back("dk_idx", gather(grads_.dk_idx, k_idx_shape(o_.seq), 1));
    r.emplace_back("dw", gather(grads_.dw, w_shape(o_.seq), 1));
    return r;
  }

  NamedArrays make_full_inputs() const override { return full_inputs(nullptr); }

  void reference_setup(const NamedArrays* full) override {
    ref_in_ = full_inputs(full);
    ref_rot_ = ref_in_;
    rope_named(rope_, ref_rot_, /*backward=*/false, false, ref_rope_positions_);
    const DType acc = accumulator_dtype(o_.dtype);  // lse and the loss arrays (fp64 for fp64 inputs)
    ref_out_ = zero_arrays(output_specs(o_.dtype, acc, true));
    // Work arrays of the indexer loss, indexed like topk_indices.
    ref_probs_ = npy::HostArray(acc, topk_shape());
    ref_scores_ = npy::HostArray(acc, topk_shape());
    ref_dscores_ = npy::HostArray(acc, topk_shape());
  }

  // One call each on the whole sequence: selection, then the attention forward.
  void reference_forward() override {
    attn::dsa_indexer_topk(ref_indexer_args(ref_rot_), ref("topk_indices"));
    attn::dsa_attention_forward(ref_attention_args(ref_rot_), ref("out"), ref("lse"));
  }

  // Attention backward (which also gives the head-summed probabilities of the selected slots), indexer scores of
  // the selected slots, the loss and its gradient, the indexer backward.
  void reference_backward() override {
    std::memset(ref_probs_.bytes.data(), 0, ref_probs_.bytes.size());
    attn::DsaAttentionBackwardArgs b;
    b.fwd = ref_attention_args(ref_rot_);
    b.out = ref("out");
    b.dout = find_array(ref_in_, "dout").view();
    b.lse = ref("lse");
    b.probs = ref_probs_.view();
    attn::dsa_attention_backward(b, ref("dq"), ref("dc"), /*accumulate=*/false);
    attn::dsa_indexer_scores_selected(ref_indexer_args(ref_rot_), ref("topk_indices"), ref_scores_.view());
    attn::DsaIndexerLossArgs l;
    l.probs = ref_probs_.view();
    l.scores = ref_scores_.view();
    l.topk_indices = ref("topk_indices");
    const double loss = attn::dsa_indexer_loss(l, ref_dscores_.view());
    ref("loss").data_as<double>()[0] = loss;
    attn::dsa_indexer_backward(ref_indexer_args(ref_rot_), ref("topk_indices"), ref_dscores_.view(), ref("dq_idx"),
                               ref("dw"), ref("dk_idx"), /*accumulate=*/false);
    rope_named(rope_, ref_out_, /*backward=*/true, false, ref_rope_positions_);
  }
  NamedArrays reference_outputs() override { return ref_out_; }

  // attn::reference on the one-rank kernel's topk_indices (the selection itself is checked exactly): dense [S, S]
  // indexer scores and per-head masked softmax, in fp64. topk_indices has no fp64 counterpart.
  NamedArrays fp64_reference_outputs() override {
    // 16-bit storage: the kernel reads the rotated copies rounded to the storage dtype, and the logits and indexer
    // scores of fp64-rotated inputs would differ from its by that rounding (a 16-bit error in the fp32 lse and loss,
    // amplified in the indexer gradients): the reference attends to the kernel's operands, ref_rot_. The rotation
    // itself is checked against the fp64 RoPE reference in fp32 and fp64.
    const bool rounded = o_.dtype == DType::kBFloat16 || o_.dtype == DType::kFloat16;
    NamedArrays in = widen_to_fp64(rounded ? ref_rot_ : ref_in_);
    if (!rounded) rope_named(rope_, in, /*backward=*/false, /*fp64_reference=*/true, ref_rope_positions_);
    const DType f64 = DType::kFloat64;
    NamedArrays r = zero_arrays(output_specs(f64, f64, false));
    const attn::DsaAttentionArgs a = ref_attention_args(in);
    const attn::DsaIndexerArgs idx = ref_indexer_args(in);
    const auto out = [&](const char* name) { return find_array(r, name).view(); };
    attn::reference::dsa_attention_forward(a, out("out"), out("lse"));
    attn::reference::dsa_attention_backward(a, find_array(in, "dout").view(), out("dq"), out("dc"));
    out("loss").data_as<double>()[0] =
        attn::reference::dsa_indexer_loss(a, idx, out("dq_idx"), out("dw"), out("dk_idx"));
    rope_named(rope_, r, /*backward=*/true, /*fp64_reference=*/true, ref_rope_positions_);
    return r;
  }

 private:
  // The full outputs in output_names() order: out and the gradients in `dtype`, lse in `lse_dtype`, loss fp64, and
  // topk_indices (int64) when `with_topk` (the fp64 reference reuses the selection of the reference run).
  std::vector<ArraySpec> output_specs(DType dtype, DType lse_dtype, bool with_topk) const {
    const std::int64_t s = o_.seq;
    std::vector<ArraySpec> r = {{"out", dtype, out_shape(s)}, {"lse", lse_dtype, lse_shape()}};
    if (with_topk) r.push_back({"topk_indices", DType::kInt64, topk_shape()});
    r.push_back({"loss", DType::kFloat64, {1}});
    const char* grads[] = {"dq", "dc", "dq_idx", "dk_idx", "dw"};
    const Shape grad_shapes[] = {q_shape(s), c_shape(s), q_idx_shape(s), k_idx_shape(s), w_shape(s)};
    for (int i = 0; i < 5; ++i) r.push_back({grads[i], dtype, grad_shapes[i]});
    return r;
  }
  Shape q_shape(std::int64_t s) const { return {o_.batch, s, o_.heads, o_.head_dim}; }
  Shape c_shape(std::int64_t s) const { return {o_.batch, s, o_.head_dim}; }
  Shape q_idx_shape(std::int64_t s) const { return {o_.batch, s, o_.indexer_heads, o_.indexer_dim}; }
  Shape k_idx_shape(std::int64_t s) const { return {o_.batch, s, o_.indexer_dim}; }
  Shape w_shape(std::int64_t s) const { return {o_.batch, s, o_.indexer_heads}; }
  Shape out_shape(std::int64_t s) const { return {o_.batch, s, o_.heads, o_.dim_v}; }
  Shape lse_shape() const { return {o_.batch, o_.heads, o_.seq}; }
  Shape topk_shape() const { return {o_.batch, o_.seq, o_.topk}; }

  // Fills q, c, q_idx, k_idx, w, dout (in that order) at `positions`, from the loaded files or from the seed.
  void fill(const NamedArrays* full, const std::vector<std::int64_t>& positions,
            const std::vector<TensorView>& dst) const {
    const std::uint64_t ids[kNumInputs] = {kIdQ, kIdC, kIdQIdx, kIdKIdx, kIdW, kIdDout};
    for (int i = 0; i < kNumInputs; ++i) {
      if (full != nullptr) {
        shard_from_full(find_array(*full, kInputNames[i]), positions, dst[i]);
      } else {
        fill_random_shard(dst[i], o_.seed, ids[i], o_.seq, positions);
      }
    }
  }

  TensorView ref(const char* name) const { return find_array(ref_out_, name).view(); }

  // The whole problem's inputs, from `full` or the seed.
  NamedArrays full_inputs(const NamedArrays* full) const {
    std::vector<ArraySpec> in;
    for (const TensorSpec& t : dsa_input_specs(o_)) in.push_back({t.name, o_.dtype, t.shape});
    NamedArrays r = zero_arrays(in);
    fill(full, all_positions(o_.seq), views_of(r));
    return r;
  }

  // The reference's arguments on the whole problem's inputs `in` (ref_rot_: the inputs after RoPE, ref_in_ without
  // it; or their fp64 copies) and the reference run's topk_indices.
  attn::DsaIndexerArgs ref_indexer_args(const NamedArrays& in) const {
    attn::DsaIndexerArgs a;
    a.q_idx = find_array(in, "q_idx").view();
    a.w = find_array(in, "w").view();
    a.k_idx = find_array(in, "k_idx").view();
    a.window = o_.window;
    a.doc_lo = ref_docs_.lo;  // packed: each token's document (slots = tokens on one rank)
    a.doc_hi = ref_docs_.hi;
    return a;
  }
  attn::DsaAttentionArgs ref_attention_args(const NamedArrays& in) const {
    attn::DsaAttentionArgs a;
    a.q = find_array(in, "q").view();
    a.c = find_array(in, "c").view();
    a.topk_indices = ref("topk_indices");
    a.dim_v = o_.dim_v;
    a.scale = dsa_softmax_scale(o_);
    return a;
  }

  npy::HostArray gather(const Tensor& local, const Shape& full_shape, int seq_dim) const {
    npy::HostArray full(local.dtype(), full_shape);
    gather_sequence(grid_.cp(), dsa_->layout(), local.view(), full.view(), seq_dim);
    return full;
  }

  void reset_layer_counters() override { dsa_->reset_counters(); }
  // With RoPE the layer sees rotated copies of q, c, q_idx, k_idx (held until the next forward).
  DsaCpOutput run_forward() override {
    if (rope_.empty()) return dsa_->forward(in_[kQ], in_[kC], in_[kQIdx], in_[kKIdx], in_[kW]);
    rotated_ = rope_rotated_copies(rope_, {in_[kQ].view(), in_[kC].view(), in_[kQIdx].view(), in_[kKIdx].view()},
                                   rope_positions_);
    return dsa_->forward(rotated_[0], rotated_[1], rotated_[2], rotated_[3], in_[kW]);
  }
  DsaCpGrads run_backward(CpContext&& ctx) override {
    DsaCpGrads g = dsa_->backward(std::move(ctx), in_[kDout]);
    rope_backward_all(rope_, {g.dq.view(), g.dc.view(), g.dq_idx.view(), g.dk_idx.view()}, rope_positions_);
    return g;
  }
  // Executed FLOPs from the pairs the forward attended (the backward revisits them at 2.5 x the cost).
  PhaseCounters forward_counters() override {
    attention_pairs_ = dsa_->counters().attention_pairs;
    PhaseCounters p = phase_counters_with_rounds(dsa_->counters());
    p.executed_flops = attention_pairs_ * attention_flops_per_pair(o_) / static_cast<double>(o_.heads);
    return p;
  }
  PhaseCounters backward_counters() override {
    PhaseCounters p = phase_counters_with_rounds(dsa_->counters());
    p.executed_flops = 2.5 * attention_pairs_ * attention_flops_per_pair(o_) / static_cast<double>(o_.heads);
    return p;
  }

  SpBenchOptions o_;
  const CpGrid& grid_;
  CpGroups groups_;
  std::unique_ptr<DsaCp> dsa_;
  enum Input { kQ, kC, kQIdx, kKIdx, kW, kDout };
  std::vector<Tensor> in_;                        // this rank's q, c, q_idx, k_idx, w, dout
  std::vector<RopeTarget> rope_;                  // the rotated inputs (dsa_rope_targets)
  std::vector<Tensor> rotated_;                   // their rotated copies of the last forward
  std::vector<std::int64_t> tokens_;              // this rank's token per local row (-1: padding)
  std::vector<std::int64_t> rope_positions_;      // this rank's RoPE positions (inside each document)
  DocBounds ref_docs_;                            // packed: each token's document bounds for the references
  std::vector<std::int64_t> ref_rope_positions_;  // packed: the references' RoPE positions (empty: 0..S-1)
  double attention_pairs_ = 0;  // (query, selected key) x local heads of the last forward on this rank
  NamedArrays ref_in_, ref_rot_, ref_out_;
  npy::HostArray ref_probs_, ref_scores_, ref_dscores_;
};

std::vector<TensorSpec> dsa_input_specs(const SpBenchOptions& o) {
  const std::int64_t B = o.batch, S = o.seq;
  return {{"q", {B, S, o.heads, o.head_dim}},
          {"c", {B, S, o.head_dim}},
          {"q_idx", {B, S, o.indexer_heads, o.indexer_dim}},
          {"k_idx", {B, S, o.indexer_dim}},
          {"w", {B, S, o.indexer_heads}},
          {"dout", {B, S, o.heads, o.dim_v}}};
}

// What DsaWorkload's step holds on one rank (sp_bench_memory.h), following DsaCp (parallel/dsa_cp.cc):
// per rank S/P rows of q [., H, Dqk], the latent c [., Dqk], the indexer inputs q_idx [., Hi, Di], k_idx [., Di],
// w [., Hi] and dout [., H, Dv]; per row k selected slots (int64 indices, fp32 scores and probabilities); fp32
// accumulators; the latent and its gradient circulate over the ring, the index keys over the CP group.
// The dense fp64 reference (attention/reference/): the inputs, the outputs (out and the gradients as large as the
// inputs, lse, topk_indices, loss) and three [S, S] planes per batch, all fp64.
Fp64ReferenceCost dsa_reference_cost(const SpBenchOptions& o) {
  const double s = static_cast<double>(o.seq), b = static_cast<double>(o.batch);
  const double elems = 2.0 * spec_elements(dsa_input_specs(o)) + b * s * static_cast<double>(o.heads + o.topk) + 1;
  const double per_pair = attention_flops_per_pair(o) * 3.5 + indexer_flops_per_pair(o) * 4;
  return {8.0 * (elems + 3.0 * b * s * s), b * s * s * per_pair};
}

WorkloadMemory dsa_memory(const SpBenchOptions& o) {
  const double e = static_cast<double>(dtype_size(o.dtype)), f = 4, pu = o.grid.ulysses_size, pr = o.grid.ring_size;
  // B x S/P, S the layout's padded length (padding rows are allocated like tokens; the host arrays hold o.seq rows)
  const double s_pad = static_cast<double>(sp_bench_padded_len(o)), unpad = static_cast<double>(o.seq) / s_pad;
  const double rows = static_cast<double>(o.batch) * s_pad / (pu * pr);
  const double q = rows * o.heads * o.head_dim, c = rows * o.head_dim, q_idx = rows * o.indexer_heads * o.indexer_dim,
               k_idx = rows * o.indexer_dim, w = rows * o.indexer_heads, out = rows * o.heads * o.dim_v;  // elements
  const double lse = f * rows * o.heads, slots = rows * static_cast<double>(o.topk);
  const double indexer = q_idx + k_idx + w;
  const double sp = pu * pr, dims = std::max<double>({static_cast<double>(o.topk), static_cast<double>(o.head_dim),
                                                      static_cast<double>(o.indexer_heads * o.indexer_dim)});
  const double scratch = o.threads * 8 * 8 * dims;  // per-thread rows of the kernels (attention/cpu/dsa_*.cc)
  WorkloadMemory m;
  m.inputs = e * (q + c + indexer + out);  // q, c, q_idx, k_idx, w, dout
  // Forward: the indexer inputs, the selection (indices and scores, this rank's and the ring group's), q_h, the
  // ring's latent, lse_h and out_h; the selection's scores and state, the fp32 accumulator and block result; the
  // outputs out, lse, topk_indices; the circulating (or gathered) index keys and latent, the Ulysses exchange.
  const double saved = e * (indexer + q + c * pu + out) + 12 * slots + 8 * slots * pu + lse;
  m.forward.saved = saved;
  m.forward.outputs = e * out + lse + 8 * slots;
  const double rope = o.rope ? e * (q + c + q_idx + k_idx) : 0;  // rotated copies, held through the backward
  m.forward.workspace = 12 * slots + 2 * f * out + lse + scratch + rope;
  const double index_keys = o.dsa_select == "ring" ? 2 * e * k_idx : e * k_idx * sp;
  const double a2a = pu > 1 ? 2 * e * std::max(q, out) : 0;
  m.forward.comm = index_keys + 2 * e * c * pu + a2a;
  // Backward: out, lse and topk_indices stay held; dout_h, delta, the ring's probabilities, dq and dc accumulators,
  // dq_h, the loss side (probabilities, scores' gradients, fp32 indexer gradients) and the gradients themselves.
  m.backward.saved = saved;
  m.backward.outputs = m.forward.outputs + e * (q + c + indexer);
  m.backward.workspace =
      e * out + lse + f * slots * pu + f * q + f * c * pu + e * q + f * c + 8 * slots + f * indexer + scratch + rope;
  m.backward.comm = 2 * e * c * pu + 4 * f * c * pu + index_keys + f * k_idx * sp + a2a;
  m.full_inputs = m.inputs * sp * unpad;
  // out, lse, topk_indices, the gradients
  m.full_outputs = ((m.backward.outputs - 8 * slots) * sp + 8 * slots * sp) * unpad;
  m.reference_scratch = 3 * f * slots * sp * unpad + m.full_inputs;  // probabilities, scores, their gradient; rotated
  return m;
}

SEQPAR_WORKLOAD_KIND(DsaWorkload) {
  WorkloadKind k;
  k.name = "dsa";
  k.description =
      "DeepSeek sparse attention (indexer top-k over the CP group, sparse latent attention over the ring, heads "
      "over Ulysses, indexer loss; always causal)";
  // DeepSeek-V3.2-Exp (config.json): qk_rope_head_dim 64, rope_theta 10000, rope_scaling yarn (factor 40, original
  // 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1: m = 1 on cos / sin, mscale^2 on the softmax scale).
  attn::RopeConfig ds_rope;
  ds_rope.pairing = attn::RopePairing::kInterleaved;
  ds_rope.rotary_dim = 64;
  ds_rope.scaling = attn::RopeScaling::kYarn;
  ds_rope.yarn.factor = 40;
  ds_rope.yarn.mscale = 1;
  ds_rope.yarn.mscale_all_dim = 1;
  k.presets = {{"deepseek-v3.2", 128, 1, 576, 2048, 0, 512, 64, 128,
                "DSA: 128 heads, latent 576 (value 512), indexer 64 heads x 128, top-k 2048, causal, RoPE on 64 "
                "columns with YaRN (factor 40)",
                0, ds_rope}};
  k.own_flags = {"topk", "dsa-select", "dim-v", "indexer-heads", "indexer-dim", "window"};
  k.input_shape_flags = {{"batch", "q", 0, &SpBenchOptions::batch},
                         {"seq", "q", 1, &SpBenchOptions::seq},
                         {"heads", "q", 2, &SpBenchOptions::heads},
                         {"head-dim", "q", 3, &SpBenchOptions::head_dim},
                         {"dim-v", "dout", 3, &SpBenchOptions::dim_v},
                         {"indexer-heads", "q_idx", 2, &SpBenchOptions::indexer_heads},
                         {"indexer-dim", "q_idx", 3, &SpBenchOptions::indexer_dim}};
  for (const std::string& f : rope_flags()) k.own_flags.push_back(f);
  k.input_specs = dsa_input_specs;
  k.estimate_memory = dsa_memory;
  k.fp64_reference_cost = dsa_reference_cost;
  k.add_json = [](const SpBenchOptions& o, nlohmann::json& j) {
    j["shape"]["topk"] = o.topk;
    j["shape"]["dim_v"] = o.dim_v;
    j["shape"]["indexer_heads"] = o.indexer_heads;
    j["shape"]["indexer_dim"] = o.indexer_dim;
    j["dsa_select"] = o.dsa_select;
    add_rope_json(o, j);
  };
  k.describe_shapes = [](const SpBenchOptions& o) {
    return str_cat("B=", o.batch, " S=", o.seq, " Hq=", o.heads, " Dqk=", o.head_dim, " causal=yes Dv=", o.dim_v,
                   " topk=", o.topk, " indexer Hi=", o.indexer_heads, " Di=", o.indexer_dim, " select=", o.dsa_select,
                   o.packed() ? str_cat(" docs=", o.doc_lens.size()) : std::string(),
                   (o.rope ? " " + describe_rope(o, dsa_rope_targets(o)[0].cfg) : std::string()),
                   o.window > 0 ? str_cat(" window=", o.window) : std::string());
  };
  k.validate = [](SpBenchOptions& o) {
    // DSA is causal by construction (key j is visible to query t iff j <= t); --causal is implied.
    SEQPAR_CHECK(o.causal || !o.given("causal"), "--causal=false: --attn dsa is causal by construction (key j is ",
                 "visible to query t iff j <= t)");
    o.causal = true;
    if (o.dim_v == 0) o.dim_v = o.head_dim;
    SEQPAR_CHECK(o.dim_v >= 1, "--dim-v ", o.dim_v, ": must be >= 1");
    SEQPAR_CHECK(o.indexer_heads >= 1, "--indexer-heads ", o.indexer_heads, ": must be >= 1");
    SEQPAR_CHECK(o.indexer_dim >= 1, "--indexer-dim ", o.indexer_dim, ": must be >= 1");
    SEQPAR_CHECK(o.dim_v <= o.head_dim, "--dim-v ", o.dim_v, preset_note(o, "dim-v"), " must be <= --head-dim ",
                 o.head_dim, preset_note(o, "head-dim"), " (the value is the first Dv columns of the latent)");
    SEQPAR_CHECK(o.heads % o.grid.ulysses_size == 0, "--heads ", o.heads, preset_note(o, "heads"),
                 " must be divisible by --ulysses-size ", o.grid.ulysses_size);
    if (o.rope) {
      SEQPAR_CHECK(o.rope_cfg.rotary_dim > 0 || !o.given("rope-dim"), "--rope-dim ", o.rope_cfg.rotary_dim,
                   ": DSA rotates the last R columns of q and the latent (and the first R of the indexer's q, k); ",
                   "give R > 0 or leave --rope-dim out for 64");
      const std::string rope_dim_note =
          o.rope_cfg.rotary_dim == 0 ? std::string(" (DSA's default)") : preset_note(o, "rope-dim");
      if (o.rope_cfg.rotary_dim == 0) o.rope_cfg.rotary_dim = 64;  // DeepSeek's qk_rope_head_dim
      check_rope_fits(o.rope_cfg, o.head_dim, "--head-dim", rope_dim_note, preset_note(o, "head-dim"));
      check_rope_fits(o.rope_cfg, o.indexer_dim, "--indexer-dim", rope_dim_note, preset_note(o, "indexer-dim"));
    }
  };
  return k;
}

}  // namespace

// DSA's own flags of `group` (sp_bench --help order; --dim-v is GDN's too; the registry: add_sp_bench_flags in
// sp_bench_options.cc).
void add_dsa_flags(cxxopts::Options& spec, FlagGroup group) {
  // clang-format off
  if (group == FlagGroup::kProblem) {
    spec.add_options("problem")
      ("topk", "DSA: selected keys per query", cxxopts::value<std::int64_t>()->default_value("2048"))
      ("dim-v", "value width (0: --head-dim); DSA: Dv, the first Dv columns of the latent; GDN: V",
       cxxopts::value<std::int64_t>()->default_value("0"))
      ("indexer-heads", "DSA: indexer heads Hi", cxxopts::value<std::int64_t>()->default_value("64"))
      ("indexer-dim", "DSA: indexer head dim Di", cxxopts::value<std::int64_t>()->default_value("128"));
  } else if (group == FlagGroup::kParallel) {
    spec.add_options("parallel")
      ("dsa-select", "DSA top-k selection over the CP group: ring (index keys circulate) | allgather (gathered "
                     "once)", cxxopts::value<std::string>()->default_value("ring"));
  }
  // clang-format on
}

}  // namespace seqpar::bench
