// ring_step_kernels: the MHA kernel calls of every (ring rank, ring step) of a layout, timed in thread CPU time on
// one process (robust against a shared machine's load, unlike wall time), next to the tile pairs sp_plan charges for
// them (SequenceLayout::step_work; the profile's mha_tile_pairs). Each call is the one RingAttention makes at that
// step: the rank's queries against the block it holds, with the layout's positions and document bounds, forward
// (mha_forward) and backward (mha_backward accumulating dq, dk, dv). The layouts run in turn in every round (a slow
// minute falls on all of them); each call's time is its minimum over the rounds.
//
//   ring_step_kernels --doc-lens 1024,512,256,128,64,64 --ring-size 2 --layouts zigzag,balanced
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cxxopts.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention/mha.h"
#include "benchmarks/bench_common.h"
#include "parallel/layout.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace seqpar {
namespace {

double thread_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

Tensor random_tensor(const Shape& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, DType::kFloat32, MemCategory::kWorkspace);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int run(int argc, char** argv) {
  cxxopts::Options opts("ring_step_kernels", "a layout's per-step MHA kernel calls in thread CPU time");
  opts.add_options()("doc-lens", "packed documents, comma-separated (else --seq, one causal row)",
                     cxxopts::value<std::string>()->default_value(""))(
      "seq", "tokens of one row (without --doc-lens)", cxxopts::value<std::string>()->default_value("2K"))(
      "ring-size", "ring ranks P", cxxopts::value<int>()->default_value("2"))(
      "heads", "heads H (Hq = Hkv)", cxxopts::value<std::int64_t>()->default_value("8"))(
      "head-dim", "D", cxxopts::value<std::int64_t>()->default_value("64"))(
      "layouts", "comma-separated: contiguous, zigzag, stripe, balanced",
      cxxopts::value<std::string>()->default_value("zigzag,balanced"))(
      "rounds", "rounds (each call's minimum over them)", cxxopts::value<int>()->default_value("7"))("help",
                                                                                                     "print the flags");
  const auto a = opts.parse(argc, argv);
  if (a.count("help")) {
    std::printf("%s\n", opts.help().c_str());
    return 0;
  }
  const int P = a["ring-size"].as<int>(), rounds = a["rounds"].as<int>();
  const std::int64_t H = a["heads"].as<std::int64_t>(), D = a["head-dim"].as<std::int64_t>();
  SEQPAR_CHECK(P >= 1 && P <= 64, "ring_step_kernels: --ring-size ", P, " must be in [1, 64]");
  SEQPAR_CHECK(rounds >= 1, "ring_step_kernels: --rounds ", rounds, " must be >= 1");
  SEQPAR_CHECK(H >= 1 && D >= 1, "ring_step_kernels: --heads ", H, " and --head-dim ", D, " must be >= 1");
  std::vector<std::int64_t> cu = {0};
  const std::string docs = a["doc-lens"].as<std::string>();
  for (const std::string& d : split(docs)) {
    const std::int64_t n = bench::parse_size(d, "--doc-lens");
    SEQPAR_CHECK(n >= 1, "ring_step_kernels: --doc-lens entry ", d, " must be >= 1");
    cu.push_back(cu.back() + n);
  }
  if (docs.empty()) cu.push_back(bench::parse_size(a["seq"].as<std::string>(), "--seq"));
  std::vector<SequenceLayout> layouts;
  std::vector<std::string> names = split(a["layouts"].as<std::string>());
  for (const std::string& n : names) layouts.push_back(SequenceLayout::packed(parse_layout(n), cu, P, 1));
  SEQPAR_CHECK(!layouts.empty(), "ring_step_kernels: --layouts names none");

  // Per layout: q, k, v, dout of one ring shard, and the outputs (the layouts' shard lengths may differ by padding).
  struct Buffers {
    Tensor q, k, v, dout, out, lse, dq, dk, dv;
  };
  std::mt19937_64 rng(1234);
  std::vector<Buffers> buf;
  for (const SequenceLayout& l : layouts) {
    const std::int64_t n = l.ring_shard_len();
    buf.push_back({random_tensor({1, n, H, D}, rng), random_tensor({1, n, H, D}, rng), random_tensor({1, n, H, D}, rng),
                   random_tensor({1, n, H, D}, rng), Tensor::empty({1, n, H, D}, DType::kFloat32),
                   Tensor::empty({1, H, n}, DType::kFloat32), Tensor::zeros({1, n, H, D}, DType::kFloat32),
                   Tensor::zeros({1, n, H, D}, DType::kFloat32), Tensor::zeros({1, n, H, D}, DType::kFloat32)});
  }
  // best[layout][(r P + s) * 2 + (0 forward, 1 backward)]
  std::vector<std::vector<double>> best(layouts.size(), std::vector<double>(2 * P * P, 1e30));
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t li = 0; li < layouts.size(); ++li) {
      const SequenceLayout& L = layouts[li];
      const Buffers& x = buf[li];
      for (int r = 0; r < P; ++r) {
        const std::vector<std::int64_t> qp = L.ring_shard_positions(r);
        const DocBounds db = L.doc_bounds_of_slots(qp);
        for (int s = 0; s < P; ++s) {
          const std::vector<std::int64_t> kp = L.ring_shard_positions((r - s + P) % P);
          attn::MhaForwardArgs f;
          f.q = x.q.view();
          f.k = x.k.view();
          f.v = x.v.view();
          f.q_pos = qp;
          f.k_pos = kp;
          f.mask = attn::MaskSpec(true, 0, db.lo, db.hi);
          const double t0 = thread_cpu_s();
          attn::mha_forward(f, x.out.view(), x.lse.view());
          const double t1 = thread_cpu_s();
          attn::MhaBackwardArgs b;
          b.fwd = f;
          b.out = x.out.view();
          b.dout = x.dout.view();
          b.lse = x.lse.view();
          attn::mha_backward(b, x.dq.view(), x.dk.view(), x.dv.view(), true);
          const double t2 = thread_cpu_s();
          double* cell = &best[li][2 * (r * P + s)];
          cell[0] = std::min(cell[0], t1 - t0);
          cell[1] = std::min(cell[1], t2 - t1);
        }
      }
    }
  }
  std::printf(
      "# ring_step_kernels: %s, P %d, H %lld, D %lld, fp32, causal, 1 thread; thread CPU time, minimum of %d "
      "rounds; tiles: SequenceLayout::step_work (64 x 64 tile pairs)\n",
      docs.empty() ? ("one row of " + std::to_string(cu.back()) + " tokens").c_str() : ("documents " + docs).c_str(), P,
      static_cast<long long>(H), static_cast<long long>(D), rounds);
  std::printf("# %-10s %4s %4s %6s %10s %10s %12s\n", "layout", "rank", "step", "tiles", "fwd(ms)", "bwd(ms)",
              "us/tile");
  for (std::size_t li = 0; li < layouts.size(); ++li) {
    double slowest = 0, slowest_tiles = 0;
    for (int r = 0; r < P; ++r) {
      double total = 0, tiles = 0;
      for (int s = 0; s < P; ++s) {
        const double* cell = &best[li][2 * (r * P + s)];
        const double t = static_cast<double>(layouts[li].step_work()[r * P + s]);
        std::printf("  %-10s %4d %4d %6.0f %10.3f %10.3f %12.2f\n", names[li].c_str(), r, s, t, cell[0] * 1e3,
                    cell[1] * 1e3, t > 0 ? (cell[0] + cell[1]) * 1e6 / t : 0.0);
        total += cell[0] + cell[1];
        tiles += t;
      }
      if (total > slowest) {
        slowest = total;
        slowest_tiles = tiles;
      }
    }
    std::printf("# %s: slowest rank %.3f ms (fwd + bwd) over %.0f tile pairs\n", names[li].c_str(), slowest * 1e3,
                slowest_tiles);
  }
  return 0;
}

}  // namespace
}  // namespace seqpar

int main(int argc, char** argv) {
  try {
    return seqpar::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
