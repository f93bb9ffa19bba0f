# SPDX-License-Identifier: Apache-2.0
"""vllm-kbit: k-bit (2-5) blockwise codebook weight quantization for vLLM.

``register()`` is the ``vllm.general_plugins`` entry point. Importing this package and
calling ``register()`` never initialises CUDA.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM plugin entry point: define the ``torch.ops.kbit`` ops (idempotent)."""
    from . import _ops

    _ops.load()
    try:
        import vllm  # noqa: F401
    except ImportError:  # the ops alone (converter, tests) work without vLLM
        return
    from . import config  # noqa: F401  (registers the "kbit" QuantizationConfig)

    _log_through_vllm()


def _log_through_vllm() -> None:
    """vLLM configures only its "vllm" logger: without its handlers kbit's INFO lines (which
    layers stay unquantized, the fusion pass) never reach vLLM's log."""
    import logging

    kbit, vllm_log = logging.getLogger("vllm_kbit"), logging.getLogger("vllm")
    if kbit.handlers or not vllm_log.handlers:
        return
    for h in vllm_log.handlers:
        kbit.addHandler(h)
    kbit.setLevel(vllm_log.level)
    kbit.propagate = False
