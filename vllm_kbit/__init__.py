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
