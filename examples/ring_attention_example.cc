// seqpar as a library: one causal attention layer with USP (Ulysses x ring) over every MPI rank, forward and
// backward, from the full sequence on one rank to the gradients back on it, checked against one rank's attention
// over the whole sequence. Run: mpirun -np N ring_attention_example (any N; exit status 0 when the check passes).
// The seqpar types it names: MpiCommunicator, CpGrid, MhaCp, Tensor, DType.
#include <seqpar/seqpar.h>

#include <cmath>
#include <cstdio>

using namespace seqpar;

namespace {

constexpr std::int64_t kBatch = 1, kSeqLen = 384, kHq = 4, kHkv = 2, kHeadDim = 32;

// Deterministic inputs in [-1, 1] (a training step would take them from the previous layer).
Tensor make_input(std::int64_t heads, int salt) {
  Tensor t = Tensor::empty({kBatch, kSeqLen, heads, kHeadDim}, DType::kFloat32);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(std::sin(0.37 * i + 1.3 * salt));
  return t;
}

// max |a - b| <= atol + rtol max |b| (fp32 rounding of a different summation order).
void expect_close(const Tensor& a, const Tensor& b, const char* name) {
  double err = 0, ref = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    err = std::fmax(err, std::fabs(a.data_as<float>()[i] - b.data_as<float>()[i]));
    ref = std::fmax(ref, std::fabs(b.data_as<float>()[i]));
  }
  std::printf("  %-4s max_abs_err %.3g (max |reference| %.3g)\n", name, err, ref);
  SEQPAR_CHECK(err <= 1e-5 + 1e-4 * ref, name, ": distributed result differs from the single-rank one by ", err);
}

}  // namespace

int main(int argc, char** argv) {
  return run_mpi_main(argc, argv, [](int, char**) {
    auto world = MpiCommunicator::world();
    const int ulysses_size = world->size() % 2 == 0 ? 2 : 1;  // any factorisation of the world size works
    const CpGrid grid(*world, {/*dp_size=*/1, ulysses_size, /*ring_size=*/world->size() / ulysses_size});
    // The layer owns its layout (zigzag by default): which tokens this rank holds. Other layers of the model take
    // the same layout (attn.layout()), so all of them agree. Default config: p2p ring, causal.
    MhaCp attn(grid, kSeqLen);
    const auto& layout = attn.layout();
    const int root = 0;  // CP rank that holds the full sequence
    const bool is_root = grid.cp().rank() == root;
    if (is_root) std::printf("seqpar %s, grid %s\n", version(), grid.str().c_str());

    // 1. The full sequence exists on the root only (here made up; in training it comes from the data loader).
    // The other ranks pass empty tensors.
    Tensor q_full, k_full, v_full, dout_full;
    if (is_root) {
      q_full = make_input(kHq, 1);
      k_full = make_input(kHkv, 2);
      v_full = make_input(kHkv, 3);
      dout_full = make_input(kHq, 4);
    }

    // 2. Each rank's shard: layout.local_len() tokens at the global positions attn.positions(); dout is the
    // gradient arriving from the layer above.
    auto local = [&](std::int64_t heads) {
      return Tensor::empty({kBatch, layout.local_len(), heads, kHeadDim}, DType::kFloat32);
    };
    Tensor q = local(kHq), k = local(kHkv), v = local(kHkv), dout = local(kHq);
    scatter_sequence(grid.cp(), layout, q_full, q, root);  // collective over the CP group
    scatter_sequence(grid.cp(), layout, k_full, k, root);
    scatter_sequence(grid.cp(), layout, v_full, v, root);
    scatter_sequence(grid.cp(), layout, dout_full, dout, root);

    // 3. RoPE with the global positions of this rank's tokens: the same rotation as rows of the full sequence.
    attn::rope_forward(q, attn.positions());
    attn::rope_forward(k, attn.positions());

    // 4. Forward: out like q, lse [B, Hq, S_local] fp32, and a context that owns what the backward needs.
    auto [out, lse, ctx] = attn.forward(q, k, v);
    // 5. Backward: consumes the context (an error if it is used twice or given to another layer object) and
    // returns dq, dk, dv like q, k, v.
    auto grads = attn.backward(std::move(ctx), dout);
    // dq, dk are gradients of the rotated q, k: the transposed rotation gives those of the inputs before RoPE.
    attn::rope_backward(grads.dq, attn.positions());
    attn::rope_backward(grads.dk, attn.positions());

    // 6. Gather: out to every rank (as the next layer of a non-parallel model would need it), the gradients to the
    // root only (each rank sends its shard, only the root allocates the full tensors).
    Tensor out_all = Tensor::empty({kBatch, kSeqLen, kHq, kHeadDim}, DType::kFloat32);
    gather_sequence(grid.cp(), layout, out, out_all);
    Tensor dq_full, dk_full, dv_full;
    if (is_root) {
      dq_full = Tensor::empty(q_full.shape(), DType::kFloat32);
      dk_full = Tensor::empty(k_full.shape(), DType::kFloat32);
      dv_full = Tensor::empty(v_full.shape(), DType::kFloat32);
    }
    gather_sequence_to_root(grid.cp(), layout, grads.dq, dq_full, root);
    gather_sequence_to_root(grid.cp(), layout, grads.dk, dk_full, root);
    gather_sequence_to_root(grid.cp(), layout, grads.dv, dv_full, root);
    if (!is_root) return 0;

    // 7. The check, on the root: one rank's kernels over the whole sequence (positions 0..S-1), the same RoPE.
    std::vector<std::int64_t> positions(kSeqLen);
    for (std::int64_t i = 0; i < kSeqLen; ++i) positions[i] = i;
    attn::rope_forward(q_full, positions);
    attn::rope_forward(k_full, positions);
    Tensor ref_out = Tensor::empty(q_full.shape(), DType::kFloat32);
    Tensor ref_lse = Tensor::empty({kBatch, kHq, kSeqLen}, DType::kFloat32);
    attn::mha_forward({.q = q_full, .k = k_full, .v = v_full, .mask = {/*causal=*/true}}, ref_out, ref_lse);
    Tensor ref_dq = Tensor::empty(q_full.shape(), DType::kFloat32);
    Tensor ref_dk = Tensor::empty(k_full.shape(), DType::kFloat32);
    Tensor ref_dv = Tensor::empty(v_full.shape(), DType::kFloat32);
    attn::mha_backward({.fwd = {.q = q_full, .k = k_full, .v = v_full, .mask = {/*causal=*/true}},
                        .out = ref_out,
                        .dout = dout_full,
                        .lse = ref_lse},
                       ref_dq, ref_dk, ref_dv, /*accumulate=*/false);
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
