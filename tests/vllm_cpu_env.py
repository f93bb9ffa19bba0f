# SPDX-License-Identifier: Apache-2.0
"""Shared by the vLLM plugin tests: vLLM's config context and distributed state for world
size 1 on the CPU (gloo), so vLLM's real layer classes can be built without a GPU."""

import socket


def vllm_cpu_env():
    """vLLM's config context and distributed state for world size 1 on CPU (gloo)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if not ps.model_parallel_is_initialized():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
            ps.initialize_model_parallel(1, 1)
        yield cfg
