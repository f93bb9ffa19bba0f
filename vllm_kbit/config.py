# SPDX-License-Identifier: Apache-2.0
"""``KbitConfig``: the vLLM ``QuantizationConfig`` registered as ``"kbit"``.

Importing this module registers the name with vLLM and never initialises CUDA.

Pre-quantized or online
-----------------------
A config is **online** (a bf16/fp16 checkpoint, quantized layer by layer while it loads)
or **pre-quantized** (the checkpoint holds ``qweight`` / ``weight_absmax`` tensors):

1. ``KbitConfig()`` -- what vLLM builds for ``--quantization kbit`` on a checkpoint
   without a ``quantization_config`` -- is online with the defaults (k = 4).
2. ``from_config(d)`` -- the checkpoint's ``quantization_config``, or the one given by
   ``--hf-overrides '{"quantization_config": {"quant_method": "kbit", "bits": 3}}'``:
   an explicit boolean ``"online"`` key decides; otherwise the config is pre-quantized
   iff ``d`` has ``"format_version"``. The converter always writes that key; an
   override dict for online mode does not need it.
3. ``maybe_update_config`` (vLLM calls it once, in the front-end process) then reads the
   safetensors headers when the model is a local directory: tensors named
   ``*.weight_absmax`` mean pre-quantized. If rule 2 guessed wrong, the checkpoint wins
   (with a warning); if ``"online"`` was explicit and contradicts it, that is an error.
   Hub ids are not looked up (no network calls while the config is built): rule 2 holds.

Patterns in ``modules_to_not_convert`` and ``module_bits`` are matched against the
checkpoint module names; for a layer that vLLM fuses (``qkv_proj``, ``gate_up_proj``)
each shard name (``q_proj``, ...) from ``packed_modules_mapping`` is matched, and all
shards must agree. An MoE layer (``...experts``) is one vLLM layer: it is left unquantized
when its own name or every expert weight name (``...experts.{e}.gate_proj``, ...) is
skipped, and all its expert weights must share one bit width.

Online mode leaves MoE router gates (linear layers named ``...gate``) unquantized, like the
converter: they are tiny and the routing decision is sensitive to their error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from . import _ops, fusion
from .format import BLOCKSIZE, KbitQuantConfig
from .linear import KbitDenseHeadMethod, KbitLinearMethod
from .moe import KbitMoEMethod

logger = init_logger(__name__)


@register_quantization_config("kbit")
class KbitConfig(QuantizationConfig):
    """k-bit (2..5) blockwise codebook weight quantization (see ``docs/format.md``)."""

    def __init__(self, quant: KbitQuantConfig | None = None, online: bool = True,
                 online_explicit: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.quant = quant if quant is not None else KbitQuantConfig()
        self.online = online
        self.online_explicit = online_explicit or quant is None  # KbitConfig(): --quantization kbit

    def __repr__(self) -> str:
        mode = "online" if self.online else "pre-quantized"
        return f"KbitConfig({mode}, bits={self.quant.bits}, module_bits={self.quant.module_bits})"

    # ------------------------------------------------------------------ vLLM API

    def get_name(self) -> str:
        return "kbit"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # no quantization_config -> vLLM calls KbitConfig(): online, k = 4

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KbitConfig:
        if not isinstance(config, Mapping):
            raise ValueError(f"kbit: quantization_config must be a JSON object, got {config!r}")
        online = config.get("online")
        if online is not None and not isinstance(online, bool):
            raise ValueError(f"kbit: 'online' must be true or false, got {online!r}")
        quant = KbitQuantConfig.from_dict({k: v for k, v in config.items() if k != "online"})
        if online is None:
            return cls(quant, online="format_version" not in config)
        return cls(quant, online=online, online_explicit=True)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:  # fmt: skip
        method = hf_quant_cfg.get("quant_method") if isinstance(hf_quant_cfg, dict) else None
        return "kbit" if str(method).lower() == "kbit" else None

    def maybe_update_config(self, model_name: str, hf_config: Any = None,
                            revision: str | None = None) -> None:  # fmt: skip
        names = _local_checkpoint_tensor_names(model_name)
        if not names:
            return
        prequantized = any(n.endswith(".weight_absmax") for n in names)
        if prequantized != self.online:
            return
        found = "kbit tensors (*.weight_absmax)" if prequantized else "no kbit tensors"
        if self.online_explicit:
            raise ValueError(
                f"kbit: asked to load {model_name} {'online' if self.online else 'pre-quantized'} "
                f"(quantization_config 'online' key, or --quantization kbit without a "
                f"quantization_config), but the checkpoint has {found}"
            )
        mode = "pre-quantized" if prequantized else "online (quantized while loading)"
        logger.warning("kbit: checkpoint %s has %s; loading it as %s", model_name, found, mode)
        self.online = not prequantized

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """Rename literal module names (``re.escape``-d, optionally ``^``/``$``-anchored)
        from HF to vLLM names; real regexes are kept as written."""
        q, mapper = self.quant, hf_to_vllm_mapper
        q.modules_to_not_convert = [_map_pattern(p, mapper) for p in q.modules_to_not_convert]
        q.module_bits = {_map_pattern(p, mapper): k for p, k in q.module_bits.items()}

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            shards = self._shard_names(prefix)
            if self._skipped(prefix, shards) or (self.online and prefix.endswith(".gate")):
                return UnquantizedLinearMethod()
            k = getattr(layer, "input_size_per_partition", layer.input_size)
            if not self._k_ok(prefix, k, layer.input_size):
                return UnquantizedLinearMethod()
            return self._method(prefix, shards)
        if isinstance(layer, ParallelLMHead):
            if not self.quant.quantize_lm_head or self.quant.is_skipped(prefix):
                return self._dense_head()
            if not self._k_ok(prefix, layer.embedding_dim, layer.embedding_dim):
                return self._dense_head()
            return self._method(prefix, [prefix])
        if _is_routed_experts(layer):
            return self._moe_method(layer, prefix)
        return None  # embeddings, attention: unquantized

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _dense_head() -> KbitDenseHeadMethod:
        _ops.load()  # the op library, as the quantized methods load it
        return KbitDenseHeadMethod()

    def _shard_names(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf)
        if not shards:
            return [prefix]
        return [f"{parent}.{s}" if parent else s for s in shards]

    def _skipped(self, prefix: str, shards: list[str]) -> bool:
        skipped = [self.quant.is_skipped(s) for s in shards]
        if any(skipped) and not all(skipped):
            detail = ", ".join(f"{s}: {'skipped' if x else 'quantized'}"
                               for s, x in zip(shards, skipped))  # fmt: skip
            raise ValueError(f"kbit: vLLM fuses {prefix} from {len(shards)} modules, and "
                             f"modules_to_not_convert skips only some of them ({detail}); "
                             "skip all or none")  # fmt: skip
        return all(skipped)

    def _k_ok(self, prefix: str, k: int, k_total: int) -> bool:
        """Whether the per-rank input size can be quantized; False = leave unquantized."""
        if k % BLOCKSIZE == 0:
            return True
        if k_total % BLOCKSIZE:
            why = f"in_features={k_total} is not a multiple of {BLOCKSIZE}"
            fix = "re-convert with this module skipped (modules_to_not_convert / --skip)"
        else:
            why = (f"in_features={k_total} is split over tensor-parallel ranks into {k} per rank, "
                   f"not a multiple of {BLOCKSIZE} (needs (in_features/32) % tp == 0)")  # fmt: skip
            fix = "use a tensor-parallel size that divides in_features/32"
        if not self.online:
            raise ValueError(f"kbit: cannot load pre-quantized {prefix}: {why}; {fix}")
        logger.warning("kbit: leaving %s unquantized: %s", prefix, why)
        return False

    def _moe_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        moe = layer.moe_config
        leaves = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
        names = [f"{prefix}.{e}.{leaf}" for e in range(moe.num_logical_experts) for leaf in leaves]
        skipped = [n for n in names if self.quant.is_skipped(n)]
        if self.quant.is_skipped(prefix) or len(skipped) == len(names):
            return UnquantizedFusedMoEMethod(moe)
        if skipped:
            raise ValueError(f"kbit: modules_to_not_convert skips {len(skipped)} of the "
                             f"{len(names)} expert weights of MoE layer {prefix} (e.g. "
                             f"{skipped[0]}); vLLM serves all experts of a layer with one "
                             f"method, so skip all of them (e.g. '{re.escape(prefix)}$') or "
                             "none")  # fmt: skip
        h, i = moe.hidden_dim, moe.intermediate_size_per_partition
        down = f"{prefix}.*.{leaves[2]}"
        if not (self._k_ok(prefix, h, h) and self._k_ok(down, i, moe.intermediate_size)):
            return UnquantizedFusedMoEMethod(moe)
        by_bits = {self.quant.bits_for(n): n for n in names}
        if len(by_bits) > 1:
            detail = ", ".join(f"{n}: {k}" for k, n in sorted(by_bits.items()))
            raise ValueError(f"kbit: module_bits gives the experts of MoE layer {prefix} "
                             f"different bit widths ({detail}); all expert weights of one MoE "
                             "layer (gate, up and down) must share one")  # fmt: skip
        k = next(iter(by_bits))
        return KbitMoEMethod(moe, k, self.quant.codebook(k), online=self.online, prefix=prefix)

    def _method(self, prefix: str, shards: list[str]) -> KbitLinearMethod:
        bits = {s: self.quant.bits_for(s) for s in shards}
        if len(set(bits.values())) > 1:
            raise ValueError(f"kbit: vLLM fuses {prefix} from modules with different module_bits "
                             f"{bits}; fused modules must share one bit width")  # fmt: skip
        k = bits[shards[0]]
        fusion.install()  # the norm / activation fusion pass (vllm_kbit/fusion.py), once
        return KbitLinearMethod(k, self.quant.codebook(k), online=self.online, prefix=prefix)


def _is_routed_experts(layer: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
    except ImportError:  # renamed in some vLLM version: do not guess
        return False
    return isinstance(layer, RoutedExperts)


def _local_checkpoint_tensor_names(model_name: str) -> set[str]:
    """Tensor names of a local safetensors checkpoint directory; empty if unknown."""
    if not Path(model_name).is_dir():
        return set()
    try:
        from vllm.transformers_utils.config import get_safetensors_params_metadata

        return set(get_safetensors_params_metadata(model_name))
    except Exception as e:  # unreadable headers: fall back to the config rule
        logger.warning("kbit: could not read safetensors metadata of %s: %s", model_name, e)
        return set()


_ESCAPED = re.compile(r"\\(.)")


def _map_pattern(pattern: str, mapper: Any) -> str:
    head = "^" if pattern.startswith("^") else ""
    tail = "$" if pattern.endswith("$") and not pattern.endswith("\\$") else ""
    body = pattern[len(head) : len(pattern) - len(tail)]
    name = _ESCAPED.sub(r"\1", body)
    if not name or re.escape(name) != body:
        return pattern  # a real regex: keep it
    mapped = mapper.apply_list([name])
    return head + re.escape(mapped[0]) + tail if mapped else pattern
