"""Time a fresh GPU machine's first pinned host allocation (it does not prevent the vLLM stall).

Evidence (2026-11-22, two fresh H100 machines, vLLM 0.26.0, torch 2.11.0+cu130, driver 580):
- The 3-7+ min stall after "Using V2 Model Runner" is NOT driver PTX JIT. ~/.nv/ComputeCache
  stayed empty (8 KiB) during a stall and after a full engine start. Every kernel a dense fp16
  eager Llama launches (vllm _C rms_norm / rotary / act_and_mul / reshape_and_cache, FA3, torch)
  ships sm_90 SASS. PTX-only code (Marlin, cutlass-2.x scaled_mm, Marlin MoE, FA2) is never
  loaded under CUDA lazy loading, the default.
- 13 faulthandler dumps of the EngineCore, taken over 7 min, were all inside
  torch.zeros(..., pin_memory=True) at vllm/v1/worker/gpu/buffer_utils.py:48. That is UvaBuffer,
  the engine's first pinned (cudaHostAlloc) allocation: 1 MiB for RequestState.all_token_ids.
  The process slept there at ~2% CPU with flat RSS. After kill -9 the device call stayed
  "in flight" for more than 16 min, so the process was probably stuck in the driver (D state).
- On another fresh H100 the first engine start ran about 9 min after boot and did not stall.
  So this is a per-machine or time-since-boot effect, not a per-process one. Later starts on
  the same machine take ~40 s.
It does NOT clear the stall (session 5, another fresh H100): this script's pinned allocation
took 0.0 s in the first call after boot, and the first vLLM engine start ~7 min later still sat
after "Using V2 Model Runner" for over 300 s (the warm-up was killed there); servers started ~2
min later came up normally. So a plain pinned torch allocation is not what stalls; the stall is
something in the engine's first start within a window after boot. Still cheap, so still run;
budget for the stall in the first vLLM start of a machine (the warm-up, 420 s limit).

Use it on the GPU machine in the first call, alongside CPU work such as building the extension
(torch from the image is enough; vLLM is not needed):
    python3 tools/vllm_prewarm.py > /tmp/prewarm.log 2>&1 &  P=$!;  <build / staging>;  wait $P
A call may not return while a process is stuck in this driver call, so wait for it in the same
call rather than leaving it behind.
"""
import os
import sys
import time

import torch


def step(name, fn):
    t = time.time()
    fn()
    print(f"PREWARM {name}: {time.time() - t:.1f} s", flush=True)


def main():
    dev = torch.device("cuda", int(os.environ.get("PREWARM_DEVICE", "0")))
    step("cuda context", lambda: torch.empty(1, device=dev))
    # the same call vLLM's UvaBuffer makes first (buffer_utils.py:48): 1024 x 256 int32, pinned
    step("first pinned alloc", lambda: torch.zeros((1024, 256), dtype=torch.int32, pin_memory=True))
    big = []
    step("pinned 256 MiB", lambda: big.append(torch.zeros(1 << 28, dtype=torch.uint8, pin_memory=True)))

    def h2d():
        big[0].to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)

    step("pinned H2D copy", h2d)
    print("PREWARM done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
