#include "parallel/ring_pass.h"

#include "parallel/cp_common.h"
#include "runtime/tensor_ops.h"

namespace seqpar {

void ring_circulate(Communicator& comm, const TensorView& local_block, int tag, const RingVisit& visit,
                    double* exposed_s, Stream stream) {
  const DeviceAlloc alloc{local_block.device(), stream};
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  Tensor buf[2] = {alloc.copy_of(local_block, local_block.dtype(), MemCategory::kCommBuffer),
                   alloc.empty(local_block.shape(), local_block.dtype(), MemCategory::kCommBuffer)};
  int cur = 0;
  for (int step = 0; step < p; ++step) {
    WorkHandle w;
    if (step + 1 < p) {
      w = comm.batch_isend_irecv(
          {P2POp::send(buf[cur].view(), next, tag), P2POp::recv(buf[1 - cur].view(), prev, tag)});
    }
    visit((r - step + p) % p, buf[cur].view());
    timed_wait(w, exposed_s);
    cur = 1 - cur;
  }
}

void ring_circulate_with_grad(Communicator& comm, const TensorView& local_block, const Shape& grad_shape,
                              const TensorView& home_grad, int tag, const RingGradVisit& visit, double* exposed_s,
                              Stream stream) {
  const DeviceAlloc alloc{common_device({local_block, home_grad}, "ring_circulate_with_grad"), stream};
  const DType acc = home_grad.dtype();
  SEQPAR_CHECK((acc == DType::kFloat32 || acc == DType::kFloat64) && home_grad.numel() == shape_numel(grad_shape),
               "ring_circulate_with_grad: home_grad ", home_grad.str(), " must be fp32 or fp64 with the elements of ",
               shape_str(grad_shape));
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  const int grad_tag = tag + 1;
  Tensor buf[2] = {alloc.copy_of(local_block, local_block.dtype(), MemCategory::kCommBuffer),
                   alloc.empty(local_block.shape(), local_block.dtype(), MemCategory::kCommBuffer)};
  // out[i]: this rank's running sum for the block of the step, sent downstream; in[i]: upstream partial sums.
  Tensor out[2] = {alloc.empty(grad_shape, acc, MemCategory::kCommBuffer),
                   alloc.empty(grad_shape, acc, MemCategory::kCommBuffer)};
  Tensor in[2];
  if (p > 1) {
    in[0] = alloc.empty(grad_shape, acc, MemCategory::kCommBuffer);
    in[1] = alloc.empty(grad_shape, acc, MemCategory::kCommBuffer);
  }
  // grads[i]: the step's exchange of accumulators (send ours downstream, receive the upstream partial), posted as
  // one group so that backends that run a communicator's operations in order (NCCL) never wait on a lone receive.
  WorkHandle grads[2];
  int cur = 0;
  for (int step = 0; step < p; ++step) {
    const int slot = step % 2;
    WorkHandle w;
    if (step + 1 < p) {
      w = comm.batch_isend_irecv(
          {P2POp::send(buf[cur].view(), next, tag), P2POp::recv(buf[1 - cur].view(), prev, tag)});
    }
    out[slot].fill_zero(alloc.stream);  // its send (two steps ago) completed when that exchange was waited for
    visit((r - step + p) % p, buf[cur].view(), out[slot].view());
    if (step > 0) {
      timed_wait(grads[1 - slot], exposed_s);  // contributions of the ranks that saw this block before us
      add_inplace(out[slot].view(), in[1 - slot].view(), stream);
    }
    if (p > 1) {
      grads[slot] = comm.batch_isend_irecv(
          {P2POp::send(out[slot].view(), next, grad_tag), P2POp::recv(in[slot].view(), prev, grad_tag)});
    }
    timed_wait(w, exposed_s);
    cur = 1 - cur;
  }
  if (p == 1) {
    alloc.copy_convert(out[0].view(), home_grad);
    return;
  }
  const int last = (p - 1) % 2;  // the last exchange brings this rank's own block home
  timed_wait(grads[last], exposed_s);
  alloc.copy_convert(in[last].view(), home_grad);
}

}  // namespace seqpar
