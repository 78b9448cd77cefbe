"""PyTorch's CPU flash-attention kernels as a co-process of kernel_bench (--kernel mha): the reference rows.

kernel_bench starts this script once and drives it over stdin / stdout, one line per request, so that PyTorch's
calls run interleaved with seqpar's in the same rounds (the two processes take turns; neither runs while the other
does). Requests and replies:
  threads N                          -> "ok"             torch.set_num_threads(N)
  clock wall|cpu                     -> "ok"             time.perf_counter (default) or time.process_time
  setup B S Hq Hkv D causal seed     -> "ok"             fp32 inputs laid out [B, S, H, D] like seqpar's, passed to
                                                          PyTorch as the [B, H, S, D] views of that memory
  fwd                                -> seconds           one forward, timed here on the chosen clock
  bwd                                -> seconds           one backward from the setup's out / logsumexp
  quit                               -> (exits)
On start it prints "ready <torch version>" or "unavailable <reason>" (torch not importable) and then exits.

The calls are the ATen operators behind torch.nn.functional.scaled_dot_product_attention's FLASH_ATTENTION backend on
the CPU (the sdpa_kernel(SDPBackend.FLASH_ATTENTION) path, without the autograd bookkeeping):
aten._scaled_dot_product_flash_attention_for_cpu and its _backward; both take GQA (Hq a multiple of Hkv) directly.
"""
import sys
import time


def main():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no reference"
        print("unavailable", type(e).__name__, str(e).splitlines()[0] if str(e) else "", flush=True)
        return
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    print("ready", torch.__version__, flush=True)
    st = {}
    clock = time.perf_counter
    for line in sys.stdin:
        w = line.split()
        if not w:
            continue
        if w[0] == "quit":
            return
        if w[0] == "threads":
            torch.set_num_threads(int(w[1]))
            print("ok", flush=True)
        elif w[0] == "clock":
            clock = time.process_time if w[1] == "cpu" else time.perf_counter
            print("ok", flush=True)
        elif w[0] == "setup":
            B, S, Hq, Hkv, D, causal, seed = (int(x) for x in w[1:8])
            g = torch.Generator().manual_seed(seed)

            def make(h):
                return (torch.rand(B, S, h, D, generator=g) * 2 - 1).transpose(1, 2)

            st = {"q": make(Hq), "k": make(Hkv), "v": make(Hkv), "dout": make(Hq), "causal": bool(causal)}
            st["out"], st["lse"] = fwd_op(st["q"], st["k"], st["v"], 0.0, st["causal"])
            print("ok", flush=True)
        elif w[0] == "fwd":
            t0 = clock()
            fwd_op(st["q"], st["k"], st["v"], 0.0, st["causal"])
            print(clock() - t0, flush=True)
        elif w[0] == "bwd":
            t0 = clock()
            bwd_op(st["dout"], st["q"], st["k"], st["v"], st["out"], st["lse"], 0.0, st["causal"])
            print(clock() - t0, flush=True)
        else:
            print("error unknown request", w[0], flush=True)


if __name__ == "__main__":
    main()
