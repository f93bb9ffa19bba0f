# SPDX-License-Identifier: Apache-2.0
"""``KbitLinearMethod``: the vLLM linear method of the kbit format.

Per layer, after loading: ``qweight`` (int32) and ``weight_absmax`` (uint8) in the 1-D
tiled runtime layout (``kbit::repack``), the non-persistent float32 buffer
``kbit_codebook``, and ``layer.kbit_n`` (output features of this rank). ``apply`` is one
``torch.ops.kbit.linear`` call; the op picks its kernel from M on the device side.

Pre-quantized: the checkpoint tensors ``qweight [N, K/32*k]`` and ``weight_absmax
[N, K/32]`` load through vLLM's v2 parameters (dim 0 = output, dim 1 = input), so
column / merged / QKV / row-parallel sharding needs no special case.
Online: a bf16/fp16 ``weight`` is created on the meta device; vLLM's layer-wise loader
materialises it once the layer is loaded and calls ``process_weights_after_loading``,
which quantizes it and drops it (peak memory: the quantized model plus one bf16 layer).
"""

from __future__ import annotations

import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.parameter import GroupQuantScaleParameter, ModelWeightParameter
from vllm.model_executor.utils import replace_parameter, set_weight_attrs

from . import _ops
from .format import BLOCKSIZE, check_bits

logger = init_logger(__name__)

_DONE = "_already_called_process_weights_after_loading"  # vLLM's flag; its reload path clears it
_DUMMY_STD = 0.02
_DUMMY_CHUNK = 1 << 24  # elements of random weight generated at a time (dummy loading)


@register_weight_loader_v2_supported_method
class KbitLinearMethod(LinearMethodBase):
    """Linear method for one layer: k-bit codes + E4M4 absmax per block of 32 along K."""

    def __init__(self, bits: int, codebook: torch.Tensor, online: bool = False,
                 prefix: str = "") -> None:  # fmt: skip
        _init_method(self, bits, codebook, online, prefix)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:  # fmt: skip
        n, k = sum(output_partition_sizes), input_size_per_partition
        if k % BLOCKSIZE:
            raise ValueError(f"kbit: {self.prefix or type(layer).__name__} has {k} input features "
                             f"per rank, not a multiple of {BLOCKSIZE}")  # fmt: skip
        weight_loader = extra_weight_attrs.pop("weight_loader")
        layer.kbit_n = n
        if self.online:
            weight = ModelWeightParameter(
                data=torch.empty(n, k, dtype=params_dtype, device="meta"),
                input_dim=1, output_dim=0, weight_loader=weight_loader)  # fmt: skip
            layer.register_parameter("weight", weight)
            set_weight_attrs(weight, extra_weight_attrs)
            _initialize_online_processing(layer)
            return
        kb = k // BLOCKSIZE
        qweight = ModelWeightParameter(
            data=torch.empty(n, kb * self.bits, dtype=torch.int32),
            input_dim=1, output_dim=0, weight_loader=weight_loader)  # fmt: skip
        absmax = GroupQuantScaleParameter(
            data=torch.empty(n, kb, dtype=torch.uint8),
            input_dim=1, output_dim=0, weight_loader=weight_loader)  # fmt: skip
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("weight_absmax", absmax)
        set_weight_attrs(qweight, extra_weight_attrs)
        set_weight_attrs(absmax, extra_weight_attrs)
        self.dummy = _load_format_is_dummy()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, _DONE, False):  # online layers are processed layer-wise, then again
            return
        if self.online:
            weight = layer.weight.data
            codebook = self.codebook.to(weight.device)
            qweight, absmax = _quantize(weight, codebook, self.bits, self.prefix)
            del layer.weight
        else:
            qweight, absmax = layer.qweight.data, layer.weight_absmax.data
            codebook = self.codebook.to(qweight.device)
            if self.dummy:  # integer params are uninitialised with load_format="dummy"
                qweight, absmax = _dummy_quantized(absmax.shape[0], absmax.shape[1] * BLOCKSIZE,
                                                   self.bits, codebook)  # fmt: skip
                self.dummy = False  # a later reload brings real weights
        qtiled, atiled = torch.ops.kbit.repack(qweight, absmax, self.bits)
        replace_parameter(layer, "qweight", qtiled)
        replace_parameter(layer, "weight_absmax", atiled)
        layer.register_buffer("kbit_codebook", codebook, persistent=False)
        setattr(layer, _DONE, True)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        n, x2d = layer.kbit_n, x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.kbit.linear(x2d, layer.qweight, layer.weight_absmax, layer.kbit_codebook,
                                  self.bits, n)  # fmt: skip
        y = y.reshape(*x.shape[:-1], n)
        return y if bias is None else y + bias

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        """A quantized lm_head tied to the (unquantized) input embedding: serve it unquantized."""
        logger.warning("kbit: %s is tied to the input embeddings, which stay unquantized; "
                       "it is served unquantized", self.prefix or "lm_head")  # fmt: skip
        for name in ("qweight", "weight_absmax", "weight"):
            layer._parameters.pop(name, None)
        layer.quant_method = KbitDenseHeadMethod()
        return layer.quant_method.tie_weights(layer, embed_tokens)


class KbitDenseHeadMethod(UnquantizedEmbeddingMethod):
    """The lm_head that kbit leaves unquantized (the default; also a skipped or tied one): vLLM's
    own fp16/bf16 weight and loading, with ``apply`` through ``kbit::dense_linear``, a streaming
    GEMV at M <= 4 tokens (cuBLAS beyond). ``KBIT_DENSE_GEMV=0`` sends every call to cuBLAS."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        w = layer.weight
        if envs.VLLM_BATCH_INVARIANT or x.dtype != w.dtype or x.dtype not in _HALF:
            return super().apply(layer, x, bias)  # vLLM's own GEMM for these
        y = torch.ops.kbit.dense_linear(x.reshape(-1, x.shape[-1]), w)
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias


_HALF = (torch.float16, torch.bfloat16)


def _init_method(method: object, bits: int, codebook: torch.Tensor, online: bool,
                 prefix: str) -> None:  # fmt: skip
    """The state KbitLinearMethod and KbitMoEMethod share (loads the ops library first)."""
    _ops.load()
    method.bits = check_bits(bits)
    method.codebook = codebook.detach().to(device="cpu", dtype=torch.float32)
    method.online = online
    method.uses_meta_device = online  # vLLM: bf16 weights on meta, layer-wise processing
    method.prefix = prefix
    method.dummy = False  # load_format="dummy": synthesise codes instead of reading garbage


def _quantize(weight: torch.Tensor, codebook: torch.Tensor, bits: int,
              prefix: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    try:
        return torch.ops.kbit.quantize(weight, codebook, bits)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"kbit: cannot quantize {prefix or 'a linear layer'}: {e}. Leave it "
                         'unquantized: --hf-overrides \'{"quantization_config": {"quant_method": '
                         '"kbit", "modules_to_not_convert": ["<regex>"]}}\'') from e  # fmt: skip


def _dummy_quantized(n: int, k: int, bits: int,
                     codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Valid codes for load_format="dummy": quantize N(0, 0.02) weights, chunk by chunk."""
    dev = codebook.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    qweight = torch.empty(n, k // BLOCKSIZE * bits, dtype=torch.int32, device=dev)
    absmax = torch.empty(n, k // BLOCKSIZE, dtype=torch.uint8, device=dev)
    rows = max(1, _DUMMY_CHUNK // k)
    for r in range(0, n, rows):
        w = torch.randn(min(rows, n - r), k, generator=gen, device=dev) * _DUMMY_STD
        qweight[r : r + rows], absmax[r : r + rows] = torch.ops.kbit.quantize(w, codebook, bits)
    return qweight, absmax


def _load_format_is_dummy() -> bool:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return False
    cfg = get_current_vllm_config_or_none()
    return cfg is not None and str(getattr(cfg.load_config, "load_format", "")) == "dummy"


def _initialize_online_processing(layer: torch.nn.Module) -> None:
    try:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
    except ImportError as e:
        raise ImportError("kbit online quantization needs vLLM's layer-wise loading "
                          "(vllm.model_executor.model_loader.reload.layerwise."
                          "initialize_online_processing, vLLM 0.26); use a pre-quantized "
                          "checkpoint with this vLLM version") from e  # fmt: skip
    initialize_online_processing(layer)
