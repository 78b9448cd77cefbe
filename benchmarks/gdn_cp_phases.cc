// gdn_cp_phases: where the time of GDN context parallelism goes, in process CPU time (robust against a shared
// machine's load, unlike wall time). Each iteration times, in one run, the whole problem on one rank (gdn_forward /
// gdn_backward on world rank 0 while the others wait) and the GdnCp call on every rank with its parts
// (GdnCp::last_phase_cpu_seconds()); rank 0 prints, per rank, each part as a share of the one-rank time over P (the
// rank's fair share). A part above its share is work the distributed call adds or runs slower. Last, rank 0 times the
// forward of the windows a waiting rank runs without and with the work ahead (its cost when split).
//
//   mpirun -np 2 gdn_cp_phases --seq 8192 --heads 8 --kv-heads 4 --head-dim 128 --layout zigzag --mode scan
#include <algorithm>
#include <cstdio>
#include <cxxopts.hpp>
#include <random>
#include <string>
#include <vector>

#include "attention/gdn.h"
#include "parallel/gdn_cp.h"
#include "runtime/cp_grid.h"
#include "runtime/error.h"
#include "runtime/mpi_comm.h"
#include "runtime/timer.h"

namespace seqpar {
namespace {

Tensor random_tensor(const Shape& shape, std::uint64_t seed, float lo, float hi) {
  Tensor t = Tensor::empty(shape, DType::kFloat32, MemCategory::kWorkspace);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = dist(rng);
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int run(int argc, char** argv) {
  cxxopts::Options opts("gdn_cp_phases", "GDN CP parts in process CPU time against the one-rank call");
  opts.add_options()("seq", "tokens", cxxopts::value<std::int64_t>()->default_value("8192"))(
      "heads", "value heads Hv", cxxopts::value<std::int64_t>()->default_value("8"))(
      "kv-heads", "key heads Hk", cxxopts::value<std::int64_t>()->default_value("4"))(
      "head-dim", "K = V", cxxopts::value<std::int64_t>()->default_value("128"))(
      "layout", "contiguous | zigzag", cxxopts::value<std::string>()->default_value("zigzag"))(
      "mode", "chain | scan", cxxopts::value<std::string>()->default_value("scan"))(
      "iters", "timed iterations (after one warm-up)", cxxopts::value<int>()->default_value("3"))(
      "help", "print the flags");
  const auto a = opts.parse(argc, argv);
  if (a.count("help")) {
    std::printf("%s\n", opts.help().c_str());
    return 0;
  }
  const std::int64_t S = a["seq"].as<std::int64_t>(), H = a["heads"].as<std::int64_t>(),
                     Hk = a["kv-heads"].as<std::int64_t>(), D = a["head-dim"].as<std::int64_t>();
  const int iters = a["iters"].as<int>();
  auto world = MpiCommunicator::world();
  const int P = world->size(), me = world->rank();
  const CpGrid grid(*world, {1, 1, P});
  const CpGroups groups = CpGroups::from(grid);
  const std::string layout_name = a["layout"].as<std::string>();
  SEQPAR_CHECK(layout_name == "zigzag" || layout_name == "contiguous", "gdn_cp_phases: --layout ", layout_name,
               " must be zigzag or contiguous");
  const LayoutKind kind = layout_name == "zigzag" ? LayoutKind::kZigzag : LayoutKind::kContiguous;
  const SequenceLayout layout = SequenceLayout::for_groups(groups, S, kind);
  GdnCpConfig cfg;
  cfg.mode = parse_gdn_cp_mode(a["mode"].as<std::string>());
  cfg.save_inputs = false;  // as sp_bench and the PyTorch module run it
  GdnCp gdn(groups, layout, cfg);

  const Tensor q = random_tensor({1, S, Hk, D}, 1, -1, 1), k = random_tensor({1, S, Hk, D}, 2, -1, 1),
               v = random_tensor({1, S, H, D}, 3, -1, 1), g = random_tensor({1, S, H}, 4, -0.1f, -0.001f),
               beta = random_tensor({1, S, H}, 5, 0.05f, 0.5f), dout = random_tensor({1, S, H, D}, 6, -1, 1);
  auto shard = [&](const Tensor& full) {
    Shape s = full.shape();
    s[1] = layout.local_len();
    Tensor t = Tensor::empty(s, DType::kFloat32, MemCategory::kWorkspace);
    shard_sequence(layout, me, full.view(), t.view());
    return t;
  };
  const Tensor lq = shard(q), lk = shard(k), lv = shard(v), lg = shard(g), lb = shard(beta), ld = shard(dout);
  Tensor out = Tensor::empty(v.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dq = Tensor::empty(q.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dk = Tensor::empty(q.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dv = Tensor::empty(v.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor dg = Tensor::empty(g.shape(), DType::kFloat32, MemCategory::kWorkspace);
  Tensor db = Tensor::empty(g.shape(), DType::kFloat32, MemCategory::kWorkspace);
  const attn::GdnForwardArgs fa = attn::gdn_args(q.view(), k.view(), v.view(), g.view(), beta.view());
  attn::GdnBackwardArgs ba;
  ba.fwd = fa;
  ba.dout = dout.view();

  // [iteration][phase 0 fwd / 1 bwd][field]: one-rank CPU time, then the CP call's parts (CPU), wait (wall).
  constexpr int kF = 9;
  std::vector<double> mine(static_cast<std::size_t>(iters * 2 * kF), 0.0);
  for (int it = -1; it < iters; ++it) {
    double one[2] = {0, 0};
    world->barrier()->wait();
    if (me == 0) {
      double c0 = process_cpu_seconds();
      attn::gdn_forward(fa, out.view(), {});
      one[0] = process_cpu_seconds() - c0;
      c0 = process_cpu_seconds();
      attn::gdn_backward(ba, dq.view(), dk.view(), dv.view(), dg.view(), db.view(), {});
      one[1] = process_cpu_seconds() - c0;
    }
    world->barrier()->wait();
    GdnCpOutput o = gdn.forward(lq.view(), lk.view(), lv.view(), lg.view(), lb.view());
    const GdnCp::PhaseSeconds f = gdn.last_phase_cpu_seconds(), fw = gdn.last_phase_seconds();
    world->barrier()->wait();
    (void)gdn.backward(std::move(o.ctx), ld.view(), {}, {lq.view(), lk.view(), lv.view(), lg.view(), lb.view()});
    const GdnCp::PhaseSeconds b = gdn.last_phase_cpu_seconds(), bw = gdn.last_phase_seconds();
    if (it < 0) continue;
    const GdnCp::PhaseSeconds* c[2] = {&f, &b};
    const GdnCp::PhaseSeconds* w[2] = {&fw, &bw};
    for (int p = 0; p < 2; ++p) {
      double* r = &mine[static_cast<std::size_t>((it * 2 + p) * kF)];
      r[0] = one[p];
      r[1] = c[p]->total;
      r[2] = c[p]->local;
      r[3] = c[p]->maps + c[p]->combine;
      r[4] = c[p]->copies;
      r[5] = w[p]->wait;
      r[6] = w[p]->total;
      r[7] = c[p]->total - c[p]->local - c[p]->maps - c[p]->combine - c[p]->copies;
      r[8] = c[p]->ahead;
    }
  }
  std::vector<double> all(mine.size() * static_cast<std::size_t>(P));
  Tensor send = Tensor::empty({static_cast<std::int64_t>(mine.size())}, DType::kFloat64, MemCategory::kWorkspace);
  Tensor recv = Tensor::empty({static_cast<std::int64_t>(all.size())}, DType::kFloat64, MemCategory::kWorkspace);
  std::copy(mine.begin(), mine.end(), send.data_as<double>());
  world->all_gather(send.view(), recv.view())->wait();
  std::copy(recv.data_as<double>(), recv.data_as<double>() + all.size(), all.begin());
  if (me != 0) return 0;
  std::printf(
      "# gdn_cp_phases: S %lld, Hv %lld / Hk %lld, K = V = %lld, %s %s, %d ranks, 1 thread each; medians of %d "
      "iterations; process CPU seconds unless noted\n",
      static_cast<long long>(S), static_cast<long long>(H), static_cast<long long>(Hk), static_cast<long long>(D),
      a["layout"].as<std::string>().c_str(), a["mode"].as<std::string>().c_str(), P, iters);
  std::printf(
      "# T1/P: the one-rank call's CPU time over P; parts as a share of it: local kernels, maps+combine, "
      "copies, rest (total - parts: waits' polling, allocation, bookkeeping), and ahead (the part of local done "
      "ahead while a message was pending); wait and total also in wall s\n");
  std::printf("%-5s %4s %9s %9s %7s %7s %7s %7s %7s %7s %9s %9s\n", "phase", "rank", "T1/P", "total", "local", "maps",
              "copies", "rest", "total", "ahead", "wait(w)", "total(w)");
  for (int p = 0; p < 2; ++p) {
    for (int r = 0; r < P; ++r) {
      std::vector<double> f[kF];
      for (int it = 0; it < iters; ++it) {
        const double* x = &all[static_cast<std::size_t>(r) * mine.size() + static_cast<std::size_t>((it * 2 + p) * kF)];
        const double* x0 = &all[static_cast<std::size_t>((it * 2 + p) * kF)];  // rank 0's one-rank time
        f[0].push_back(x0[0] / P);
        for (int i = 1; i < kF; ++i) f[i].push_back(x[i]);
      }
      const double share = median(f[0]);
      std::printf("%-5s %4d %9.4f %9.4f %7.3f %7.3f %7.3f %7.3f %7.3f %7.3f %9.4f %9.4f\n", p == 0 ? "fwd" : "bwd", r,
                  share, median(f[1]), median(f[2]) / share, median(f[3]) / share, median(f[4]) / share,
                  median(f[7]) / share, median(f[1]) / share, median(f[8]) / share, median(f[5]), median(f[6]));
    }
  }
  // What the work ahead costs: the forward of the windows a waiting rank runs (S / P rows, one value head each),
  // without it, and split into the work ahead (all chunks) and the window that uses it; rank 0 alone.
  const std::int64_t rows = S / P;
  Tensor wout = Tensor::empty({1, S, H, D}, DType::kFloat32, MemCategory::kWorkspace);
  Tensor wfin = Tensor::empty({1, 1, D, D}, DType::kFloat32, MemCategory::kWorkspace);
  std::vector<double> whole, ahead, rest;
  for (int it = -1; it < iters; ++it) {
    double t_whole = 0, t_ahead = 0, t_rest = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const attn::GdnWindow w{0, rows, h, 1};
      double c0 = process_cpu_seconds();
      attn::gdn_forward_window(fa, w, wout.view(), wfin.view(), nullptr);
      t_whole += process_cpu_seconds() - c0;
      c0 = process_cpu_seconds();
      attn::GdnAhead ah = attn::gdn_forward_ahead(fa, w);
      while (!attn::gdn_ahead_step(fa, ah, 4)) {
      }
      t_ahead += process_cpu_seconds() - c0;
      c0 = process_cpu_seconds();
      attn::gdn_forward_window(fa, w, wout.view(), wfin.view(), &ah);
      t_rest += process_cpu_seconds() - c0;
    }
    if (it < 0) continue;
    whole.push_back(t_whole);
    ahead.push_back(t_ahead);
    rest.push_back(t_rest);
  }
  const double tw = median(whole), ta = median(ahead), tr = median(rest);
  std::printf(
      "# work ahead, forward of %lld windows of %lld rows (rank 0 alone, CPU s, medians): without %.4f; ahead %.4f "
      "(%.2f of without) + the rest %.4f (%.2f) = %.4f (%.2f)\n",
      static_cast<long long>(H), static_cast<long long>(rows), tw, ta, ta / tw, tr, tr / tw, ta + tr, (ta + tr) / tw);
  return 0;
}

}  // namespace
}  // namespace seqpar

int main(int argc, char** argv) {
  seqpar::MpiSession session(&argc, &argv);
  try {
    return seqpar::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gdn_cp_phases: %s\n", e.what());
    return 1;
  }
}
