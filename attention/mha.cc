// Public boundary of the MHA / GQA kernels: argument validation (callable on its own through the validate members
// of the argument structs), dispatch to the CPU kernels in cpu/, the LSE merge and the backward delta. Math:
// attention/mha.h.
#include "attention/mha.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "attention/boundary.h"
#include "attention/cpu/mha_cpu.h"
#include "attention/cpu/scratch.h"
#include "attention/kernels/row_ops.h"
#include "attention/lowering.h"
#include "runtime/error.h"
#include "runtime/tensor_ops.h"
#include "runtime/tensor_checks.h"

#if defined(SEQPAR_WITH_CUDA)
#include "attention/cuda/mha_cuda.h"
#endif

namespace seqpar::attn {
namespace {

constexpr const char* kFamily = "MHA";

void check_positions(std::span<const std::int64_t> pos, std::int64_t len, const char* what, const char* len_name) {
  SEQPAR_CHECK(pos.empty() || static_cast<std::int64_t>(pos.size()) == len, what, " has ", pos.size(),
               " entries, expected 0 (meaning 0..", len - 1, ") or ", len_name, " = ", len);
  detail::check_non_decreasing(pos, what);
}

void check_mask(const MaskSpec& mask, std::int64_t sq) {
  SEQPAR_CHECK(mask.doc_lo.size() == mask.doc_hi.size() &&
                   (mask.doc_lo.empty() || static_cast<std::int64_t>(mask.doc_lo.size()) == sq),
               "mask.doc_lo / doc_hi have ", mask.doc_lo.size(), " / ", mask.doc_hi.size(),
               " entries, expected both 0 (no document bounds) or both Sq = ", sq);
  SEQPAR_CHECK(mask.window >= 0, "mask.window ", mask.window, " must be >= 0 (0: no window)");
  SEQPAR_CHECK(mask.window == 0 || mask.causal, "mask.window ", mask.window,
               " requires mask.causal = true (sliding windows are causal)");
}

void check_host_tensor(const TensorView& t, const char* what) { detail::check_floating(t, what, kFamily); }

// The positions ALiBi and dropout read (MhaForwardArgs::mod_q_pos / mod_k_pos, else q_pos / k_pos).
std::span<const std::int64_t> mod_positions(std::span<const std::int64_t> mod, std::span<const std::int64_t> pos) {
  return mod.empty() ? pos : mod;
}

// Dropout's rules (p; with p > 0 the ranges of the generator's counter) and its kernel parameters.
cpu::MhaDropout check_dropout_args(const MhaForwardArgs& a, std::int64_t B, std::int64_t Hq) {
  a.dropout.validate(kFamily);
  cpu::MhaDropout d;
  if (a.dropout.p == 0.0) return d;
  constexpr std::int64_t kLimit = std::int64_t{1} << 32;
  SEQPAR_CHECK(a.head_offset >= 0 && a.head_offset + Hq <= kLimit && B <= kLimit, "dropout: head_offset ",
               a.head_offset, " + Hq ", Hq, " and batch ", B, " must lie in [0, 2^32] (the generator's counter)");
  for (auto [pos, what] : {std::pair{mod_positions(a.mod_q_pos, a.q_pos), "q_pos"},
                           {mod_positions(a.mod_k_pos, a.k_pos), "k_pos"}}) {
    SEQPAR_CHECK(pos.empty() || (pos.front() >= 0 && pos.back() < kLimit), "dropout: ", what, " [", pos.front(), ", ",
                 pos.back(), "] must lie in [0, 2^32) (the generator's counter)");
  }
  SEQPAR_CHECK(a.q_tokens.empty() || static_cast<std::int64_t>(a.q_tokens.size()) == a.q.dim(1), "dropout: q_tokens has ",
               a.q_tokens.size(), " entries, expected 0 (tokens = q_pos) or Sq = ", a.q.dim(1));
  for (std::int64_t t : a.q_tokens) {
    SEQPAR_CHECK(t >= -1 && t < kLimit, "dropout: q_tokens entry ", t,
                 " must lie in [0, 2^32) (the generator's counter) or be -1 (a padding row)");
  }
  d.on = true;
  d.seed = a.dropout.seed;
  d.threshold = dropout_threshold(a.dropout.p);
  d.scale = 1.0 / (1.0 - a.dropout.p);
  d.head_offset = a.head_offset;
  d.q_pos = mod_positions(a.mod_q_pos, a.q_pos);
  d.k_pos = mod_positions(a.mod_k_pos, a.k_pos);
  d.q_tokens = a.q_tokens;
  return d;
}

// lse and delta: [B, H, S] of the accumulator dtype of `storage` or fp64 (never narrower than the accumulators).
void check_rows(const TensorView& t, const Shape& shape, DType storage, const char* what) {
  detail::check_host(t, what, kFamily);
  check_shape(t, shape, what);
  const DType acc = accumulator_dtype(storage);
  SEQPAR_CHECK(t.dtype() == acc || t.dtype() == DType::kFloat64, what, " has dtype ", dtype_name(t.dtype()),
               ", expected ", dtype_name(acc), acc == DType::kFloat64 ? "" : " or fp64", " for ", dtype_name(storage),
               " inputs");
}

// Element i of an fp32 or fp64 tensor, as double / set from a double.
double load(const TensorView& t, std::int64_t i) {
  return t.dtype() == DType::kFloat64 ? static_cast<const double*>(t.data())[i]
                                      : static_cast<double>(static_cast<const float*>(t.data())[i]);
}
void store(const TensorView& t, std::int64_t i, double value) {
  if (t.dtype() == DType::kFloat64) {
    static_cast<double*>(t.data())[i] = value;
  } else {
    static_cast<float*>(t.data())[i] = static_cast<float>(value);
  }
}

// A per-head vector of ScoreMods (alibi_slopes, sinks): empty, or [heads] fp32 / fp64 finite host; as doubles.
std::vector<double> check_head_vector(const TensorView& t, std::int64_t heads, const char* what) {
  if (t.empty()) return {};
  detail::check_host(t, what, kFamily);
  SEQPAR_CHECK(t.ndim() == 1 && t.dim(0) == heads, what, " must be [Hq] = [", heads, "] (one per query head), got ",
               t.str());
  SEQPAR_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, what, " has dtype ", dtype_name(t.dtype()),
               ", expected fp32 or fp64");
  std::vector<double> values(static_cast<std::size_t>(heads));
  for (std::int64_t h = 0; h < heads; ++h) {
    values[h] = load(t, h);
    SEQPAR_CHECK(std::isfinite(values[h]), what, "[", h, "] = ", values[h], " must be finite");
  }
  return values;
}

// q, k, v on the host (the CPU kernels); in a CUDA build with q on a CUDA device, the rules of the CUDA path
// (attention/cuda/mha_cuda.h: one device, the features it refuses) instead.
void check_qkv_device(const MhaForwardArgs& a) {
#if defined(SEQPAR_WITH_CUDA)
  if (a.q.device().is_cuda()) return cuda::check_forward_fields(a);
#endif
  check_host_tensor(a.q, "q");
  check_host_tensor(a.k, "k");
  check_host_tensor(a.v, "v");
}

// Validates q, k, v, positions and mask; returns the filled kernel parameters (ranges not yet set).
cpu::MhaParams check_forward_args(const MhaForwardArgs& a) {
  SEQPAR_CHECK(a.q.ndim() == 4, "q must be [B, Sq, Hq, D], got ", a.q.str());
  SEQPAR_CHECK(a.k.ndim() == 4, "k must be [B, Sk, Hkv, D], got ", a.k.str());
  check_qkv_device(a);
  const std::int64_t B = a.q.dim(0), Sq = a.q.dim(1), Hq = a.q.dim(2), D = a.q.dim(3);
  const std::int64_t Sk = a.k.dim(1), Hkv = a.k.dim(2);
  SEQPAR_CHECK(a.k.dim(0) == B && a.k.dim(3) == D, "k ", a.k.str(), " must match q ", a.q.str(),
               " in batch (dim 0) and head_dim (dim 3)");
  check_shape(a.v, a.k.shape(), "v");
  SEQPAR_CHECK(a.k.dtype() == a.q.dtype() && a.v.dtype() == a.q.dtype(), "q, k, v must share one dtype, got q ",
               dtype_name(a.q.dtype()), ", k ", dtype_name(a.k.dtype()), ", v ", dtype_name(a.v.dtype()));
  SEQPAR_CHECK(D > 0, "head_dim (q dim 3) must be > 0, got ", D);
  SEQPAR_CHECK(Hkv > 0 && Hq % Hkv == 0, "q heads Hq = ", Hq, " must be a multiple of kv heads Hkv = ", Hkv);
  SEQPAR_CHECK(std::isfinite(a.scale), "scale ", a.scale, " must be finite (0 or less: 1/sqrt(D))");
  check_positions(a.q_pos, Sq, "q_pos", "Sq");
  check_positions(a.k_pos, Sk, "k_pos", "Sk");
  if (!a.mod_q_pos.empty()) check_positions(a.mod_q_pos, Sq, "mod_q_pos", "Sq");
  if (!a.mod_k_pos.empty()) check_positions(a.mod_k_pos, Sk, "mod_k_pos", "Sk");
  check_mask(a.mask, Sq);
  SEQPAR_CHECK(std::isfinite(a.mods.softcap) && a.mods.softcap >= 0.0, "softcap ", a.mods.softcap,
               " must be finite and > 0 (0: no soft-capping)");
  const double scale =
      a.scale > 0.0 ? detail::real_option(a.scale, a.q.dtype()) : 1.0 / std::sqrt(static_cast<double>(D));
  cpu::MhaParams p{a.q.data(),
                   a.k.data(),
                   a.v.data(),
                   a.q.dtype(),
                   B,
                   Sq,
                   Sk,
                   Hq,
                   Hkv,
                   D,
                   scale,
                   nullptr,
                   detail::real_option(a.mods.softcap, a.q.dtype()),
                   check_head_vector(a.mods.alibi_slopes, Hq, "alibi_slopes"),
                   check_head_vector(a.mods.sinks, Hq, "sinks"),
                   mod_positions(a.mod_q_pos, a.q_pos),
                   mod_positions(a.mod_k_pos, a.k_pos),
                   check_dropout_args(a, B, Hq)};
  return p;
}

cpu::MhaParams validate_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse) {
  const cpu::MhaParams p = check_forward_args(args);
  check_host_tensor(out, "out");
  check_shape(out, args.q.shape(), "out");
  check_rows(lse, {p.batch, p.hq, p.sq}, p.dtype, "lse");
  return p;
}

void check_wide(const TensorView& t, const Shape& shape, const char* what);

cpu::MhaParams validate_backward(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk,
                                 const TensorView& dv, bool accumulate) {
  const cpu::MhaParams p = check_forward_args(args.fwd);
  check_host_tensor(args.dout, "dout");
  check_shape(args.dout, args.fwd.q.shape(), "dout");
  check_rows(args.lse, {p.batch, p.hq, p.sq}, p.dtype, "lse");
  if (!args.delta.empty()) {
    check_rows(args.delta, {p.batch, p.hq, p.sq}, p.dtype, "delta");
  } else {
    check_host_tensor(args.out, "out (needed for delta, which was not given)");
    check_shape(args.out, args.fwd.q.shape(), "out");
  }
  if (!args.dlse.empty()) check_wide(args.dlse, {p.batch, p.hq, p.sq}, "dlse");
  for (auto [t, like, name] :
       {std::tuple{&dq, &args.fwd.q, "dq"}, {&dk, &args.fwd.k, "dk"}, {&dv, &args.fwd.k, "dv"}}) {
    check_host_tensor(*t, name);
    check_shape(*t, like->shape(), name);
    if (accumulate) check_dtype(*t, accumulator_dtype(p.dtype), str_cat(name, " (accumulate = true)").c_str());
  }
  return p;
}

void validate_delta(const TensorView& out, const TensorView& dout, const TensorView& delta) {
  check_host_tensor(out, "out");
  check_host_tensor(dout, "dout");
  SEQPAR_CHECK(out.ndim() == 4, "out must be [B, S, H, D], got ", out.str());
  check_shape(dout, out.shape(), "dout");
  // fp64 when either input is fp64, so that an fp64 delta is never rounded through fp32
  const bool wide = out.dtype() == DType::kFloat64 || dout.dtype() == DType::kFloat64;
  check_rows(delta, {out.dim(0), out.dim(2), out.dim(1)}, wide ? DType::kFloat64 : DType::kFloat32, "delta");
}

// A host fp32 / fp64 tensor of the given shape (lse_merge, sinks).
void check_wide(const TensorView& t, const Shape& shape, const char* what) {
  detail::check_host(t, what, kFamily);
  check_shape(t, shape, what);
  SEQPAR_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64, what, " has dtype ", dtype_name(t.dtype()),
               ", expected fp32 or fp64");
}

void validate_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b) {
  SEQPAR_CHECK(out.ndim() == 4, "lse_merge: out must be [B, S, H, D], got ", out.str());
  const Shape rows{out.dim(0), out.dim(2), out.dim(1)};
  for (auto [t, shape, what] : {std::tuple{&out, &out.shape(), "lse_merge out"},
                                {&out_b, &out.shape(), "lse_merge out_b"},
                                {&lse, &rows, "lse_merge lse"},
                                {&lse_b, &rows, "lse_merge lse_b"}})
    check_wide(*t, *shape, what);
}

void zero_fill(const TensorView& t) {
  if (t.numel() > 0) std::memset(t.data(), 0, t.nbytes());
}

void check_backward_delta(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
  detail::check_stream(stream, "mha_backward_delta", kFamily);
  validate_delta(out, dout, delta);
}

void check_lse_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
                     Stream stream) {
  detail::check_stream(stream, "lse_merge", kFamily);
  validate_merge(out, lse, out_b, lse_b);
}

void check_apply_sinks(const TensorView& out, const TensorView& lse, const TensorView& sinks, Stream stream) {
  detail::check_stream(stream, "mha_apply_sinks", kFamily);
  SEQPAR_CHECK(out.ndim() == 4, "mha_apply_sinks: out must be [B, S, H, D], got ", out.str());
  check_wide(out, out.shape(), "mha_apply_sinks out");
  check_wide(lse, {out.dim(0), out.dim(2), out.dim(1)}, "mha_apply_sinks lse");
  SEQPAR_CHECK(!sinks.empty(), "mha_apply_sinks: sinks must be [H] = [", out.dim(2), "], got an empty tensor");
  check_head_vector(sinks, out.dim(2), "sinks");
}

}  // namespace

void DropoutSpec::validate(const char* what) const {
  SEQPAR_CHECK(std::isfinite(p) && p >= 0.0 && p < 1.0, what, ": dropout p ", p,
               " must be a finite number in [0, 1) (0: no dropout)");
}

// ---- validation of the argument structs --------------------------------------------------------------------------

void MhaForwardArgs::validate() const { check_forward_args(*this); }

void MhaForwardArgs::validate(const TensorView& out, const TensorView& lse, Stream stream) const {
#if defined(SEQPAR_WITH_CUDA)
  if (q.device().is_cuda()) {
    check_forward_args(*this);
    return cuda::check_forward_call(*this, out, lse, stream);
  }
#endif
  detail::check_stream(stream, "mha_forward", kFamily);
  validate_forward(*this, out, lse);
}

void MhaBackwardArgs::validate(const TensorView& dq, const TensorView& dk, const TensorView& dv, bool accumulate,
                               Stream stream) const {
#if defined(SEQPAR_WITH_CUDA)
  if (fwd.q.device().is_cuda()) {
    check_forward_args(fwd);
    return cuda::check_backward_call(*this, dq, dk, dv, accumulate, stream);
  }
#endif
  detail::check_stream(stream, "mha_backward", kFamily);
  validate_backward(*this, dq, dk, dv, accumulate);
}

void MhaSinksBackwardArgs::validate(const TensorView& dsinks, Stream stream) const {
#if defined(SEQPAR_WITH_CUDA)
  if (lse.device().is_cuda()) {  // lse, delta, dsinks and the stream on one CUDA device; sinks on the host
    const Device d = lse.device();
    SEQPAR_CHECK(lse.ndim() == 3, "mha_sinks_backward: lse must be [B, H, S], got ", lse.str());
    for (auto [t, shape, what] : {std::tuple{&lse, lse.shape(), "lse"},
                                  {&delta, lse.shape(), "delta"},
                                  {&dsinks, Shape{lse.dim(1)}, "dsinks"}}) {
      SEQPAR_CHECK(t->device() == d && (t->numel() == 0 || t->data() != nullptr), "mha_sinks_backward: ", what, " ",
                   t->str(), " is on ", t->device().str(), ", expected ", d.str(), " (lse's device)");
      check_shape(*t, shape, what);
      SEQPAR_CHECK(t->dtype() == DType::kFloat32 || t->dtype() == DType::kFloat64, "mha_sinks_backward: ", what,
                   " has dtype ", dtype_name(t->dtype()), ", expected fp32 or fp64");
    }
    SEQPAR_CHECK(stream.device == d, "mha_sinks_backward: stream on ", stream.device.str(), ", tensors on ", d.str());
    SEQPAR_CHECK(!sinks.empty(), "mha_sinks_backward: sinks must be [H] = [", lse.dim(1), "], got an empty tensor");
    check_head_vector(sinks, lse.dim(1), "sinks");
    return;
  }
#endif
  detail::check_stream(stream, "mha_sinks_backward", kFamily);
  SEQPAR_CHECK(lse.ndim() == 3, "mha_sinks_backward: lse must be [B, H, S], got ", lse.str());
  check_wide(lse, lse.shape(), "mha_sinks_backward lse");
  check_wide(delta, lse.shape(), "mha_sinks_backward delta");
  check_wide(dsinks, {lse.dim(1)}, "mha_sinks_backward dsinks");
  SEQPAR_CHECK(!sinks.empty(), "mha_sinks_backward: sinks must be [H] = [", lse.dim(1), "], got an empty tensor");
  check_head_vector(sinks, lse.dim(1), "sinks");
}

// ---- the kernels ---------------------------------------------------------------------------------------------------

void mha_forward(const MhaForwardArgs& args, const TensorView& out, const TensorView& lse, Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (args.q.device().is_cuda()) {  // attention/cuda/mha_cuda.h, after the rules every device shares (mods, dropout)
    (void)check_forward_args(args);
    return cuda::mha_forward_cuda(args, out, lse, stream);
  }
#endif
  detail::check_stream(stream, "mha_forward", kFamily);
  cpu::MhaParams p = validate_forward(args, out, lse);
  if (detail::route_to_lowered(args)) return mha_forward_lowered(args, out, lse, stream);  // test mode
  if (p.batch * p.sq * p.hq == 0) return;
  if (p.sk == 0) {
    zero_fill(out);
    for (std::int64_t i = 0; i < lse.numel(); ++i) store(lse, i, -std::numeric_limits<double>::infinity());
    return;
  }
  const cpu::KeyRanges ranges = cpu::key_ranges(args.q_pos, p.sq, args.k_pos, p.sk, args.mask);
  p.ranges = &ranges;
  cpu::mha_forward_cpu(p, out.data(), out.dtype(), lse.data(), lse.dtype());
}

void mha_backward(const MhaBackwardArgs& args, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  bool accumulate, Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (args.fwd.q.device().is_cuda()) {
    (void)check_forward_args(args.fwd);
    return cuda::mha_backward_cuda(args, dq, dk, dv, accumulate, stream);
  }
#endif
  detail::check_stream(stream, "mha_backward", kFamily);
  cpu::MhaParams p = validate_backward(args, dq, dk, dv, accumulate);
  if (p.batch * p.sq * p.hq == 0 || p.sk == 0) {
    if (!accumulate) {
      zero_fill(dq);
      zero_fill(dk);
      zero_fill(dv);
    }
    return;
  }
  // With dlse the kernels run with delta - dlse (fp64), computed here.
  Tensor delta_dlse;
  if (!args.dlse.empty()) {
    delta_dlse = Tensor::empty(args.lse.shape(), DType::kFloat64, MemCategory::kWorkspace);
    if (args.delta.empty()) {
      mha_backward_delta(args.out, args.dout, delta_dlse.view(), stream);
    } else {
      copy_convert(args.delta, delta_dlse.view(), stream);
    }
    double* d = delta_dlse.view().data_as<double>();
    for (std::int64_t i = 0; i < delta_dlse.numel(); ++i) d[i] -= load(args.dlse, i);
  }
  const TensorView delta = args.dlse.empty() ? args.delta : delta_dlse.view();
  if (detail::route_to_lowered(args.fwd)) {  // test mode, with the dlse already folded into delta
    MhaBackwardArgs lowered = args;
    lowered.delta = delta;
    lowered.dlse = {};
    return mha_backward_lowered(lowered, dq, dk, dv, accumulate, stream);
  }
  const bool have_delta = !delta.empty();
  const cpu::KeyRanges ranges = cpu::key_ranges(args.fwd.q_pos, p.sq, args.fwd.k_pos, p.sk, args.fwd.mask);
  p.ranges = &ranges;
  cpu::MhaBackwardParams bp;
  bp.fwd = p;
  bp.dout = args.dout.data();
  bp.dout_dtype = args.dout.dtype();
  bp.out = have_delta ? nullptr : args.out.data();
  bp.out_dtype = have_delta ? DType::kFloat32 : args.out.dtype();
  bp.lse = args.lse.data();
  bp.lse_dtype = args.lse.dtype();
  bp.delta = have_delta ? delta.data() : nullptr;
  bp.delta_dtype = have_delta ? delta.dtype() : DType::kFloat64;
  bp.dq = dq.data();
  bp.dk = dk.data();
  bp.dv = dv.data();
  bp.dq_dtype = dq.dtype();
  bp.dk_dtype = dk.dtype();
  bp.dv_dtype = dv.dtype();
  bp.accumulate = accumulate;
  cpu::mha_backward_cpu(bp);
}

void mha_backward_delta(const TensorView& out, const TensorView& dout, const TensorView& delta, Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (out.device().is_cuda()) return cuda::mha_backward_delta_cuda(out, dout, delta, stream);
#endif
  check_backward_delta(out, dout, delta, stream);
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  const bool wide = delta.dtype() == DType::kFloat64;
  const char* o = static_cast<const char*>(out.data());
  const char* g = static_cast<const char*>(dout.data());
  const std::size_t os = dtype_size(out.dtype()), gs = dtype_size(dout.dtype());
  const bool parallel = static_cast<double>(out.numel()) >= cpu::kMinParallelWork;
  const cpu::WorkerScratch<double> wide_ws({wide ? D : 0, wide ? D : 0}, "mha_backward_delta scratch",
                                           cpu::region_workers(parallel));
  const cpu::WorkerScratch<float> ws({wide ? 0 : D, wide ? 0 : D}, "mha_backward_delta scratch",
                                     cpu::region_workers(parallel));
#pragma omp parallel if (parallel)
  {
    const std::span<double> ro = wide_ws.buffer(0), rg = wide_ws.buffer(1);
    const std::span<float> fo = ws.buffer(0), fg = ws.buffer(1);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < B * S * H; ++t) {
      const std::int64_t b = t / (S * H), i = (t / H) % S, h = t % H;
      const std::size_t e = static_cast<std::size_t>(t * D);
      double sum = 0.0;
      if (wide) {
        convert(o + e * os, out.dtype(), ro.data(), DType::kFloat64, static_cast<std::size_t>(D));
        convert(g + e * gs, dout.dtype(), rg.data(), DType::kFloat64, static_cast<std::size_t>(D));
        for (std::int64_t d = 0; d < D; ++d) sum += ro[d] * rg[d];
      } else {
        convert(o + e * os, out.dtype(), fo.data(), DType::kFloat32, static_cast<std::size_t>(D));
        convert(g + e * gs, dout.dtype(), fg.data(), DType::kFloat32, static_cast<std::size_t>(D));
        float acc = 0.0f;
        for (std::int64_t d = 0; d < D; ++d) acc += fo[d] * fg[d];
        sum = acc;
      }
      store(delta, (b * H + h) * S + i, sum);
    }
  }
}

void lse_merge(const TensorView& out, const TensorView& lse, const TensorView& out_b, const TensorView& lse_b,
               Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (out.device().is_cuda()) return cuda::lse_merge_cuda(out, lse, out_b, lse_b, stream);
#endif
  check_lse_merge(out, lse, out_b, lse_b, stream);
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
#pragma omp parallel for schedule(static) if (static_cast <double>(out.numel()) >= cpu::kMinParallelWork)
  for (std::int64_t t = 0; t < B * S * H; ++t) {
    const std::int64_t b = t / (S * H), i = (t / H) % S, h = t % H;
    const std::int64_t li = (b * H + h) * S + i;
    // the body shared with the device kernels (attention/kernels/row_ops.h): no inf - inf, no cancellation
    const rowops::MergeWeights<double> w = rowops::lse_merge_weights(load(lse, li), load(lse_b, li));
    for (std::int64_t d = 0; d < D; ++d)
      store(out, t * D + d, rowops::lse_merge_value(w, load(out, t * D + d), load(out_b, t * D + d)));
    store(lse, li, w.lse);
  }
}

void mha_apply_sinks(const TensorView& out, const TensorView& lse, const TensorView& sinks, Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (out.device().is_cuda()) {  // out and lse on the device, sinks on the host (attention/cuda/mha_cuda.h)
    SEQPAR_CHECK(out.ndim() == 4, "mha_apply_sinks: out must be [B, S, H, D], got ", out.str());
    SEQPAR_CHECK(!sinks.empty(), "mha_apply_sinks: sinks must be [H] = [", out.dim(2), "], got an empty tensor");
    return cuda::apply_sinks_cuda(out, lse, check_head_vector(sinks, out.dim(2), "sinks"), stream);
  }
#endif
  check_apply_sinks(out, lse, sinks, stream);
  const std::int64_t B = out.dim(0), S = out.dim(1), H = out.dim(2), D = out.dim(3);
  for (std::int64_t t = 0; t < B * S * H; ++t) {
    const std::int64_t b = t / (S * H), i = (t / H) % S, h = t % H;
    const std::int64_t li = (b * H + h) * S + i;
    double l = load(lse, li);
    const double factor = cpu::add_sink(l, load(sinks, h));
    for (std::int64_t d = 0; d < D; ++d) store(out, t * D + d, factor * load(out, t * D + d));
    store(lse, li, l);
  }
}

void mha_sinks_backward(const MhaSinksBackwardArgs& args, const TensorView& dsinks, Stream stream) {
#if defined(SEQPAR_WITH_CUDA)
  if (args.lse.device().is_cuda()) {
    // delta and lse ([B, H, S], small) read back in fp64 and summed by the host loop below; dsinks written back
    args.validate(dsinks, stream);
    const Device d = args.lse.device();
    auto to_host = [&](const TensorView& t) {
      const Tensor wide = Tensor::copy_of(t, DType::kFloat64, MemCategory::kWorkspace, stream);
      Tensor h = Tensor::empty(t.shape(), DType::kFloat64, MemCategory::kWorkspace);
      copy_convert(wide.view(), h.view(), stream);
      return h;
    };
    const Tensor lse = to_host(args.lse), delta = to_host(args.delta);
    Tensor ds = Tensor::empty(dsinks.shape(), DType::kFloat64, MemCategory::kWorkspace);
    mha_sinks_backward({delta.view(), lse.view(), args.sinks}, ds.view());
    Tensor ds_d = Tensor::empty(dsinks.shape(), DType::kFloat64, MemCategory::kWorkspace, d);
    copy_convert(ds.view(), ds_d.view(), stream);
    copy_convert(ds_d.view(), dsinks, stream);
    return;
  }
#endif
  args.validate(dsinks, stream);
  const TensorView& delta = args.delta;
  const TensorView& lse = args.lse;
  const TensorView& sinks = args.sinks;
  const std::int64_t B = lse.dim(0), H = lse.dim(1), S = lse.dim(2);
  for (std::int64_t h = 0; h < H; ++h) {
    const double sink = load(sinks, h);
    double sum = 0.0;
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t li = (b * H + h) * S + i;
        const double l = load(lse, li);
        if (l != -std::numeric_limits<double>::infinity()) sum += std::exp(sink - l) * load(delta, li);
      }
    }
    store(dsinks, h, -sum);
  }
}

std::vector<float> alibi_slopes(std::int64_t num_heads) {
  SEQPAR_CHECK(num_heads >= 1, "alibi_slopes: num_heads ", num_heads, " must be >= 1");
  // 2^(-8 (h + 1) / n) for h < count, taking every `step`-th of the n slopes
  auto geometric = [](std::int64_t n, std::int64_t count, std::int64_t step, std::vector<float>& out) {
    for (std::int64_t h = 0; h < count; ++h)
      out.push_back(static_cast<float>(std::exp2(-8.0 * static_cast<double>(h * step + 1) / static_cast<double>(n))));
  };
  std::int64_t pow2 = 1;
  while (pow2 * 2 <= num_heads) pow2 *= 2;
  std::vector<float> slopes;
  geometric(pow2, pow2, 1, slopes);
  geometric(2 * pow2, num_heads - pow2, 2, slopes);
  return slopes;
}

std::int64_t visible_pairs(std::span<const std::int64_t> q_pos, std::span<const std::int64_t> k_pos,
                           const MaskSpec& mask) {
  detail::check_non_decreasing(q_pos, "q_pos");
  detail::check_non_decreasing(k_pos, "k_pos");
  check_mask(mask, static_cast<std::int64_t>(q_pos.size()));
  const cpu::KeyRanges r = cpu::key_ranges(q_pos, static_cast<std::int64_t>(q_pos.size()), k_pos,
                                           static_cast<std::int64_t>(k_pos.size()), mask);
  std::int64_t n = 0;
  for (std::size_t i = 0; i < r.begin.size(); ++i) n += std::max<std::int64_t>(0, r.end[i] - r.begin[i]);
  return n;
}

}  // namespace seqpar::attn
