#include "tests/util/device_collectives.h"

#include <gtest/gtest.h>

#include "runtime/error.h"
#include "runtime/nccl_comm.h"
#include "runtime/tensor_ops.h"
#include "tests/util/test_util.h"
#include "tests/util/units.h"

namespace seqpar::test {

// ---- exact "unit" data (the scheme of tests/mpi/test_comm.cc) -------------------------------------------------
// Small integers stored as units x 2^k with a dtype-dependent power of two; every sum here stays within 256 units,
// so bf16 / fp16 reductions are exact in any order and every comparison is exact.

// A device buffer holding `units` (one entry per element), copied from the host.
Tensor on_device(DType dtype, const std::vector<std::int64_t>& units) {
  const auto n = static_cast<std::int64_t>(units.size());
  Tensor host = Tensor::empty({n}, dtype, MemCategory::kCommBuffer);
  for (std::int64_t i = 0; i < n; ++i) put(host, i, units[i]);
  Tensor dev = Tensor::empty({n}, dtype, MemCategory::kCommBuffer, Device::cuda(device_ordinal_from_local_rank()));
  copy_convert(host, dev);
  return dev;
}
Tensor filled_on_device(DType dtype, std::int64_t n, std::int64_t units) {
  return on_device(dtype, std::vector<std::int64_t>(static_cast<std::size_t>(n), units));
}

int mod(int a, int p) { return ((a % p) + p) % p; }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  return "<no error>";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string agreed_skip_reason(Communicator& w, std::string local_reason, const char* why_other) {
  if (!all_ranks(w, local_reason.empty()) && local_reason.empty()) local_reason = str_cat("another rank ", why_other);
  return local_reason;
}

std::int64_t right_units(int src, int i) { return 1 + src * 16 + i; }
std::int64_t left_units(int src, int i) { return 130 + src * 15 + i; }

// ---- collective cases shared by both backends ------------------------------------------------------------------

void check_all_to_all(Communicator& w) {
  const int p = w.size(), r = w.rank(), block = 3;
  auto units = [&](int s, int d, int j) { return std::int64_t{1} + (s * p + d) * block + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(p * block), want(p * block);
    for (int d = 0; d < p; ++d)
      for (int j = 0; j < block; ++j) {
        mine[d * block + j] = units(r, d, j);
        want[d * block + j] = units(d, r, j);
      }
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, p * block, -1);
    w.all_to_all(send, recv)->wait();
    EXPECT_TRUE(units_equal(recv, want, "all_to_all"));
  }
}

void check_all_to_all_v(Communicator& w) {
  const int p = w.size(), r = w.rank();
  auto count = [](int s, int d) { return static_cast<std::int64_t>((s + 2 * d + 1) % 3); };
  auto units = [&](int s, int d, int j) { return std::int64_t{1} + (s * p + d) * 2 + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> send_counts(p), recv_counts(p), mine, want;
    for (int q = 0; q < p; ++q) {
      send_counts[q] = count(r, q);
      recv_counts[q] = count(q, r);
      for (int j = 0; j < count(r, q); ++j) mine.push_back(units(r, q, j));
      for (int j = 0; j < count(q, r); ++j) want.push_back(units(q, r, j));
    }
    const auto recv_total = static_cast<std::int64_t>(want.size());
    mine.insert(mine.end(), {-3, -3});
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, recv_total + 3, -7);
    w.all_to_all_v(send, send_counts, recv, recv_counts)->wait();
    want.insert(want.end(), {-7, -7, -7});
    EXPECT_TRUE(units_equal(recv, want, "all_to_all_v (with a 3-element untouched tail)"));
    const std::vector<std::int64_t> zeros(p, 0);
    Tensor empty_send = filled_on_device(dtype, 0, 0), sentinel = filled_on_device(dtype, 1, -9);
    w.all_to_all_v(empty_send, zeros, sentinel, zeros)->wait();
    EXPECT_TRUE(units_equal(sentinel, {-9}, "all_to_all_v with all counts zero"));
  }
}

void check_all_gather(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 3;
  auto units = [](int s, int j) { return std::int64_t{1} + s * 3 + j; };
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(n), want(p * n);
    for (int j = 0; j < n; ++j) mine[j] = units(r, j);
    for (int s = 0; s < p; ++s)
      for (int j = 0; j < n; ++j) want[s * n + j] = units(s, j);
    Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, p * n, -1);
    w.all_gather(send, recv)->wait();
    EXPECT_TRUE(units_equal(recv, want, "all_gather"));
  }
}

void check_reduce_scatter(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 2;
  auto sum_units = [](int s, int d, int j) { return (s % 2 ? -1 : 1) * std::int64_t{1 + s + 2 * d + j}; };
  auto max_units = [](int s, int d, int j) { return std::int64_t{(s * 5 + d * 3 + j) % 7 - 3}; };
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      auto x = [&](int s, int d, int j) { return op == ReduceOp::kSum ? sum_units(s, d, j) : max_units(s, d, j); };
      std::vector<std::int64_t> mine(p * n), want(n);
      for (int d = 0; d < p; ++d)
        for (int j = 0; j < n; ++j) mine[d * n + j] = x(r, d, j);
      for (int j = 0; j < n; ++j) {
        std::int64_t acc = op == ReduceOp::kSum ? 0 : INT64_MIN;
        for (int s = 0; s < p; ++s) acc = op == ReduceOp::kSum ? acc + x(s, r, j) : std::max(acc, x(s, r, j));
        want[j] = acc;
      }
      Tensor send = on_device(dtype, mine), recv = filled_on_device(dtype, n, -100);
      w.reduce_scatter(send, recv, op)->wait();
      EXPECT_TRUE(units_equal(recv, want, str_cat("reduce_scatter(", reduce_op_name(op), ")")));
    }
  }
}

void check_all_reduce(Communicator& w) {
  const int p = w.size(), r = w.rank();
  for (DType dtype : kAllDTypes) {
    for (std::int64_t n : {std::int64_t{7}, std::int64_t{4099}}) {
      std::vector<std::int64_t> mine(n), want(n);
      // Sum: x(s, j) = +-(s + 1)(j % 3 + 1), total +-p(p+1)/2 (j % 3 + 1).
      for (std::int64_t j = 0; j < n; ++j) {
        mine[j] = (j % 2 ? -1 : 1) * (r + 1) * (j % 3 + 1);
        want[j] = (j % 2 ? -1 : 1) * std::int64_t{p} * (p + 1) / 2 * (j % 3 + 1);
      }
      Tensor sum = on_device(dtype, mine);
      w.all_reduce(sum, ReduceOp::kSum)->wait();
      EXPECT_TRUE(units_equal(sum, want, str_cat("all_reduce(sum) of ", n)));
      // Max: x(s, j) = 2 ((s + j) mod p) - 5 + j % 2, whose max over s is 2 (p - 1) - 5 + j % 2.
      for (std::int64_t j = 0; j < n; ++j) {
        mine[j] = 2 * ((r + j) % p) - 5 + j % 2;
        want[j] = 2 * (p - 1) - 5 + j % 2;
      }
      Tensor mx = on_device(dtype, mine);
      w.all_reduce(mx, ReduceOp::kMax)->wait();
      EXPECT_TRUE(units_equal(mx, want, str_cat("all_reduce(max) of ", n)));
    }
  }
}

void check_broadcast(Communicator& w) {
  const int p = w.size(), r = w.rank(), n = 4;
  for (DType dtype : kAllDTypes) {
    for (int root = 0; root < p; ++root) {
      std::vector<std::int64_t> want(n), mine(n, -1);
      for (int j = 0; j < n; ++j) want[j] = 1 + root * 4 + j;
      Tensor buf = on_device(dtype, r == root ? want : mine);
      w.broadcast(buf, root)->wait();
      EXPECT_TRUE(units_equal(buf, want, str_cat("broadcast from root ", root)));
    }
  }
}

// Both directions around the ring in one batch, plus a second message to the right with the same tag (matched in
// posting order).
void check_batch_ring_both_directions(Communicator& w) {
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 6;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> to_right(n), to_left(n), second(n), want_left(n), want_right(n), want_second(n);
    for (int i = 0; i < n; ++i) {
      to_right[i] = right_units(r, i);
      second[i] = right_units(r, i) + 100;
      to_left[i] = left_units(r, i);
      want_left[i] = right_units(left, i);
      want_second[i] = right_units(left, i) + 100;
      want_right[i] = left_units(right, i);
    }
    Tensor a = on_device(dtype, to_right), b = on_device(dtype, to_left), c = on_device(dtype, second);
    Tensor from_left = filled_on_device(dtype, n, -1), from_right = filled_on_device(dtype, n, -1),
           second_from_left = filled_on_device(dtype, n, -1);
    w.batch_isend_irecv({P2POp::send(a, right, 5), P2POp::recv(from_right, right, 6), P2POp::send(b, left, 6),
                         P2POp::recv(from_left, left, 5), P2POp::send(c, right, 5),
                         P2POp::recv(second_from_left, left, 5)})
        ->wait();
    EXPECT_TRUE(units_equal(from_left, want_left, "batch: first message from the left"));
    EXPECT_TRUE(units_equal(second_from_left, want_second, "batch: second message from the left"));
    EXPECT_TRUE(units_equal(from_right, want_right, "batch: message from the right"));
  }
}

// P - 1 steps of forwarding around the ring (as ring attention moves K/V), one batch per step.
void check_ring_forwarding(Communicator& w) {
  const int p = w.size(), r = w.rank(), right = mod(r + 1, p), left = mod(r - 1, p), n = 5;
  for (DType dtype : kAllDTypes) {
    std::vector<std::int64_t> mine(n);
    for (int i = 0; i < n; ++i) mine[i] = right_units(r, i);
    Tensor cur = on_device(dtype, mine), next = filled_on_device(dtype, n, -1);
    for (int step = 1; step < p; ++step) {
      w.batch_isend_irecv({P2POp::send(cur, right, step), P2POp::recv(next, left, step)})->wait();
      std::swap(cur, next);
      std::vector<std::int64_t> want(n);
      for (int i = 0; i < n; ++i) want[i] = right_units(mod(r - step, p), i);
      EXPECT_TRUE(units_equal(cur, want, str_cat("block after step ", step)));
    }
  }
}

void check_byte_counters(Communicator& w, const FilledBuffer& filled, bool lone_p2p) {
  const std::int64_t p = w.size();
  const int r = w.rank(), right = mod(r + 1, w.size()), left = mod(r - 1, w.size());
  auto expect_counters = [&](std::int64_t sent, std::int64_t received, std::int64_t ops, const char* what) {
    EXPECT_EQ(w.counters().bytes_sent, sent) << "rank " << r << ": " << what;
    EXPECT_EQ(w.counters().bytes_received, received) << "rank " << r << ": " << what;
    EXPECT_EQ(w.counters().num_ops, ops) << "rank " << r << ": " << what;
    w.reset_counters();
  };
  w.reset_counters();
  expect_counters(0, 0, 0, "after reset");
  if (lone_p2p) {
    Tensor a = filled(DType::kFloat32, 5, 1), b = filled(DType::kFloat32, 5, 0);
    WorkHandle s = w.isend(a, right, 3), q = w.irecv(b, left, 3);
    q->wait();
    s->wait();
    expect_counters(20, 20, 2, "isend + irecv of 5 fp32");
  }
  Tensor c = filled(DType::kBFloat16, 3, 1), d = filled(DType::kBFloat16, 3, 1), e = filled(DType::kBFloat16, 3, 0),
         f = filled(DType::kBFloat16, 3, 0);
  w.batch_isend_irecv(
       {P2POp::send(c, right, 4), P2POp::send(d, left, 5), P2POp::recv(e, left, 4), P2POp::recv(f, right, 5)})
      ->wait();
  expect_counters(12, 12, 1, "batch of 2 sends + 2 receives of 3 bf16");

  Tensor a2a_send = filled(DType::kFloat64, p * 3, 1), a2a_recv = filled(DType::kFloat64, p * 3, 0);
  w.all_to_all(a2a_send, a2a_recv)->wait();
  expect_counters(3 * 8 * (p - 1), 3 * 8 * (p - 1), 1, "all_to_all of 3 fp64 per rank");

  std::vector<std::int64_t> counts(p);
  for (int q = 0; q < p; ++q) counts[q] = q + 1;  // everyone sends q+1 to rank q, receives r+1 from each
  const std::vector<std::int64_t> recv_counts(p, r + 1);
  Tensor v_send = filled(DType::kInt64, p * (p + 1) / 2, 1), v_recv = filled(DType::kInt64, p * (r + 1), 0);
  w.all_to_all_v(v_send, counts, v_recv, recv_counts)->wait();
  expect_counters(8 * (p * (p + 1) / 2 - (r + 1)), 8 * (p - 1) * (r + 1), 1, "all_to_all_v");

  Tensor g_send = filled(DType::kInt32, 4, 1), g_recv = filled(DType::kInt32, 4 * p, 0);
  w.all_gather(g_send, g_recv)->wait();
  expect_counters(16 * (p - 1), 16 * (p - 1), 1, "all_gather of 4 int32");

  Tensor rs_send = filled(DType::kFloat32, 2 * p, 1), rs_recv = filled(DType::kFloat32, 2, 0);
  w.reduce_scatter(rs_send, rs_recv, ReduceOp::kSum)->wait();
  expect_counters(8 * (p - 1), 8 * (p - 1), 1, "reduce_scatter to 2 fp32");

  Tensor ar = filled(DType::kFloat64, 10, 1);
  w.all_reduce(ar, ReduceOp::kSum)->wait();
  expect_counters(2 * 80 * (p - 1) / p, 2 * 80 * (p - 1) / p, 1, "all_reduce of 80 bytes (ring volume)");

  Tensor bc = filled(DType::kFloat16, 6, 1);
  w.broadcast(bc, 0)->wait();
  if (r == 0) {
    expect_counters(12 * (p - 1), 0, 1, "broadcast root");
  } else {
    expect_counters(0, 12, 1, "broadcast non-root");
  }
  w.barrier()->wait();
  expect_counters(0, 0, 1, "barrier");
}

}  // namespace seqpar::test
