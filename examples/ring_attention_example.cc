// seqpar as a library: one causal attention layer with USP (Ulysses x ring) over every MPI rank, forward and
// backward, from the full sequence on one rank to the gradients back on it, checked against one rank's attention
// over the whole sequence. Run: mpirun -np N ring_attention_example (any N; exit status 0 when the check passes).
#include <seqpar/attention/mha.h>     // attn::mha_forward / mha_backward: the single-rank kernels (the check)
#include <seqpar/attention/rope.h>    // attn::rope_forward / rope_backward on global positions
#include <seqpar/parallel/layout.h>   // SequenceLayout, scatter_sequence, gather_sequence, gather_sequence_to_root
#include <seqpar/parallel/usp.h>      // UspAttention (ring when ulysses_size = 1, Ulysses when ring_size = 1)
#include <seqpar/runtime/error.h>     // SEQPAR_CHECK
#include <seqpar/runtime/memory.h>    // memory_ledger: bytes per category
#include <seqpar/runtime/mpi_comm.h>  // run_mpi_main, MpiCommunicator
#include <seqpar/runtime/sp_grid.h>   // SpGrid
#include <seqpar/runtime/version.h>   // seqpar::version()

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

using namespace seqpar;

namespace {

constexpr std::int64_t kBatch = 1, kSeqLen = 384, kHq = 4, kHkv = 2, kHeadDim = 32;

// Deterministic inputs in [-1, 1] (a training step would take them from the previous layer).
Tensor make_input(std::int64_t heads, int salt, MemCategory category) {
  Tensor t = Tensor::empty({kBatch, kSeqLen, heads, kHeadDim}, DType::kFloat32, category);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(std::sin(0.37 * i + 1.3 * salt));
  return t;
}

std::int64_t saved_activation_bytes() {
  return memory_ledger().snapshot().current[static_cast<int>(MemCategory::kSavedActivation)];
}

// max |a - b| <= atol + rtol max |b| (fp32 rounding of a different summation order).
void expect_close(const TensorView& a, const TensorView& b, const char* name) {
  const float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  double err = 0, ref = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(x[i] - y[i])));
    ref = std::max(ref, static_cast<double>(std::fabs(y[i])));
  }
  std::printf("  %-4s max_abs_err %.3g (max |reference| %.3g)\n", name, err, ref);
  SEQPAR_CHECK(err <= 1e-5 + 1e-4 * ref, name, ": distributed result differs from the single-rank one by ", err);
}

}  // namespace

int main(int argc, char** argv) {
  return run_mpi_main(argc, argv, [](int, char**) {
    auto world = MpiCommunicator::world();
    const int ulysses_size = world->size() % 2 == 0 ? 2 : 1;  // any factorisation of the world size works
    const SpGrid grid(*world, {/*dp_size=*/1, ulysses_size, /*ring_size=*/world->size() / ulysses_size});
    const CpGroups groups = CpGroups::from(grid);  // the grid's Ulysses, ring and SP communicators (+ a stream)
    // One layout for the whole model (zigzag by default): every CP layer takes it, so all layers agree on which
    // tokens this rank holds.
    const SequenceLayout layout = SequenceLayout::for_groups(groups, kSeqLen);
    UspAttention attn(groups, layout, RingAttentionConfig{});  // p2p ring, causal by default
    const int root = 0;                                        // SP rank that holds the full sequence
    const bool is_root = groups.sp_rank() == root;
    if (is_root) std::printf("seqpar %s, grid %s\n", version(), grid.str().c_str());

    // 1. The full sequence exists on the root only (here made up; in training it comes from the data loader):
    // staging memory, ledger category workspace, freed with the Tensor objects. The other ranks pass empty views.
    Tensor q_full, k_full, v_full, dout_full;
    if (is_root) {
      q_full = make_input(kHq, 1, MemCategory::kWorkspace);
      k_full = make_input(kHkv, 2, MemCategory::kWorkspace);
      v_full = make_input(kHkv, 3, MemCategory::kWorkspace);
      dout_full = make_input(kHq, 4, MemCategory::kWorkspace);
    }

    // 2. Each rank's shard: layout.local_len() tokens at the global positions attn.positions(). q, k, v are the
    // layer's activations (category saved_activation), dout the gradient arriving from the layer above (workspace).
    const std::int64_t s_local = layout.local_len();
    auto local = [&](std::int64_t heads, MemCategory category) {
      return Tensor::empty({kBatch, s_local, heads, kHeadDim}, DType::kFloat32, category);
    };
    Tensor q = local(kHq, MemCategory::kSavedActivation), k = local(kHkv, MemCategory::kSavedActivation);
    Tensor v = local(kHkv, MemCategory::kSavedActivation), dout = local(kHq, MemCategory::kWorkspace);
    scatter_sequence(groups.sp, layout, q_full, q, root);  // collective over the SP group
    scatter_sequence(groups.sp, layout, k_full, k, root);
    scatter_sequence(groups.sp, layout, v_full, v, root);
    scatter_sequence(groups.sp, layout, dout_full, dout, root);

    // 3. RoPE with the global positions of this rank's tokens: the same rotation as rows of the full sequence.
    attn::rope_forward(q, attn.positions());
    attn::rope_forward(k, attn.positions());

    // 4. Forward: out like q, lse [B, Hq, S_local] fp32, and a CpContext. The context owns what the backward needs
    // (its tensors are in category saved_activation) until it is handed to backward(), which frees them.
    const std::int64_t saved_before = saved_activation_bytes();
    auto [out, lse, ctx] = attn.forward(q, k, v);
    const std::int64_t saved_by_forward = saved_activation_bytes() - saved_before;
    // 5. Backward: consumes the context (an error if it is used twice or given to another layer object).
    AttentionGrads grads = attn.backward(std::move(ctx), dout);
    SEQPAR_CHECK(saved_activation_bytes() == saved_before, "the backward did not free the context's tensors");
    // dq, dk are gradients of the rotated q, k: the transposed rotation gives those of the inputs before RoPE.
    attn::rope_backward(grads.dq, attn.positions());
    attn::rope_backward(grads.dk, attn.positions());

    // 6. Gather: out to every rank (as the next layer of a non-parallel model would need it), the gradients to the
    // root only (each rank sends its shard, only the root allocates the full tensors).
    Tensor out_all = Tensor::empty({kBatch, kSeqLen, kHq, kHeadDim}, DType::kFloat32, MemCategory::kWorkspace);
    gather_sequence(groups.sp, layout, out, out_all);
    Tensor dq_full, dk_full, dv_full;
    if (is_root) {
      dq_full = Tensor::empty(q_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
      dk_full = Tensor::empty(k_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
      dv_full = Tensor::empty(v_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
    }
    gather_sequence_to_root(groups.sp, layout, grads.dq, dq_full, root);
    gather_sequence_to_root(groups.sp, layout, grads.dk, dk_full, root);
    gather_sequence_to_root(groups.sp, layout, grads.dv, dv_full, root);
    if (!is_root) return 0;

    // 7. The check, on the root: one rank's kernels over the whole sequence (positions 0..S-1), the same RoPE.
    std::printf("forward saved %lld bytes per rank (saved_activation), freed by the backward\n",
                static_cast<long long>(saved_by_forward));
    std::vector<std::int64_t> positions(kSeqLen);
    std::iota(positions.begin(), positions.end(), 0);
    attn::rope_forward(q_full, positions);
    attn::rope_forward(k_full, positions);
    attn::MhaForwardArgs args;
    args.q = q_full;
    args.k = k_full;
    args.v = v_full;
    args.mask.causal = true;
    Tensor ref_out = Tensor::empty(q_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
    Tensor ref_lse = Tensor::empty({kBatch, kHq, kSeqLen}, DType::kFloat32, MemCategory::kWorkspace);
    attn::mha_forward(args, ref_out, ref_lse);
    Tensor ref_dq = Tensor::empty(q_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
    Tensor ref_dk = Tensor::empty(k_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
    Tensor ref_dv = Tensor::empty(v_full.shape(), DType::kFloat32, MemCategory::kWorkspace);
    attn::MhaBackwardArgs bargs;
    bargs.fwd = args;
    bargs.out = ref_out;
    bargs.dout = dout_full;
    bargs.lse = ref_lse;
    attn::mha_backward(bargs, ref_dq, ref_dk, ref_dv, /*accumulate=*/false);
    attn::rope_backward(ref_dq, positions);
    attn::rope_backward(ref_dk, positions);
    expect_close(out_all, ref_out, "out");
    expect_close(dq_full, ref_dq, "dq");
    expect_close(dk_full, ref_dk, "dk");
    expect_close(dv_full, ref_dv, "dv");
    std::printf("ok: matches the single-rank result\n");
    return 0;
  });
}
