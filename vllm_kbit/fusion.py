# SPDX-License-Identifier: Apache-2.0
"""A post-grad graph pass for vLLM's torch.compile: folds the elementwise op that feeds a kbit
linear layer into the layer.

In a Llama-style decoder layer three of the four linear layers follow an elementwise kernel:
qkv_proj and gate_up_proj follow ``fused_add_rms_norm``, down_proj follows ``SiluAndMul``. At
decode batch sizes each of those kernels plus its launch gap costs 2-3 us, about as much as a
small layer's weights, and it stands between two kbit kernels that could otherwise overlap
through programmatic dependent launch. The pass rewrites

    normed, residual = vllm_ir.fused_add_rms_norm(x, residual, w, eps)
    y = kbit.linear(normed, ...)              -> y, residual = kbit.linear_add_rms_norm(x, residual, w, eps, ...)

    y = kbit.linear(silu(h[:, :d]) * h[:, d:], ...)   -> y = kbit.linear_silu_mul(h, ...)

where the normed / activated tensor has no other user. The fused ops compute the same values
(vllm_kbit/reference.py: linear_add_rms_norm, linear_silu_mul); on the GPU at M <= 8 the GEMV
kernel does the elementwise work while it stages x (csrc/gemv.cuh, XPro).

vLLM runs the pass as its ``post_grad_custom_post_pass`` (after its own fusion passes, before
its IR lowering), installed by ``install()`` when the first kbit linear layer is built and vLLM compiles the model
(not with ``--enforce-eager``); ``VLLM_KBIT_FUSION=0`` turns it off. It applies to the graph vLLM
compiles for batches of <= FUSE_MAX_M tokens, which install() splits off. ``fuse_graph`` is plain
torch.fx and is what the tests run.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import fx

logger = logging.getLogger(__name__)

_PASS_KEY = "post_grad_custom_post_pass"
# The pass rewrites only the graph vLLM compiles for batches of at most this many tokens;
# install() makes vLLM compile that range on its own. The folded GEMV recomputes the norm /
# activation of all of x in every CTA, which grows with M: in a 32-layer 8B chain on an H100 it
# took 0.91-0.92x the unfused (inductor + kbit::linear) time per layer at M=1, 0.93x at M=2 and
# 0.99-1.01x at M=4 (k = 2, 4; benchmarks/results/bench_fused_chain_h100_s36.md; M=8 was 1.13-1.18x
# before the activation used fast exp, _s36_tokpar.md). Above M=2 the unfused graph runs
# (inductor's Triton kernels also beat kbit's separate elementwise kernels).
FUSE_MAX_M = 2


def enabled() -> bool:
    """VLLM_KBIT_FUSION=0 turns the pass off (read when a model is built)."""
    return os.environ.get("VLLM_KBIT_FUSION", "1") != "0"


def _is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _ir_norm_op() -> Any:
    """vLLM 0.26's IR op ``vllm_ir.fused_add_rms_norm`` (None where vLLM has no IR ops)."""
    ns = getattr(torch.ops, "vllm_ir", None)
    op = getattr(ns, "fused_add_rms_norm", None) if ns is not None else None
    return getattr(op, "default", None)


def _strip_views(node: Any) -> Any:
    """The node behind view / reshape nodes that keep its 2-D shape (``x.reshape(-1, K)``)."""
    views = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
             torch.ops.aten._unsafe_view.default)  # fmt: skip
    while _is_call(node, *views) and len(node.users) == 1:
        src, out = _val(node.args[0]), _val(node)
        if src is None or out is None or src.dim() != 2 or tuple(src.shape) != tuple(out.shape):
            break
        node = node.args[0]
    return node


def _defined_before(graph: fx.Graph, args: list[Any], anchor: fx.Node) -> bool:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return all(order[a] < order[anchor] for a in args if isinstance(a, fx.Node))


def _set_fake_val(fused: fx.Node, getitems: list[fx.Node] = ()) -> None:
    """meta['val'] of a new node (and of its getitem nodes), from the op's fake implementation:
    inductor and vLLM's later passes read it."""
    from torch._guards import detect_fake_mode

    vals = [_val(a) if isinstance(a, fx.Node) else a for a in fused.args]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:  # a graph without fake values (plain torch.fx)
        return
    with fake_mode:
        out = fused.target(*vals)
    fused.meta["val"] = out
    for n in getitems:
        n.meta["val"] = out[n.args[1]]


def _fuse_norm(graph: fx.Graph, lin: fx.Node, x: fx.Node) -> bool:
    """normed, res = fused_add_rms_norm(...); kbit.linear(normed) -> linear_add_rms_norm."""
    norm_op = _ir_norm_op()
    if norm_op is None or not (_is_call(x, operator.getitem) and x.args[1] == 0):
        return False
    norm = x.args[0]
    if not _is_call(norm, norm_op) or len(x.users) != 1 or norm.kwargs:
        return False
    x_in, residual, weight, eps = norm.args[:4]
    variance_size = norm.args[4] if len(norm.args) > 4 else None
    if variance_size is not None or not isinstance(weight, fx.Node) or not isinstance(eps, float):
        return False
    xv, rv, wv = _val(x_in), _val(residual), _val(weight)
    if xv is None or rv is None or wv is None or xv.dim() != 2 or wv.dim() != 1:
        return False
    if not (xv.dtype == rv.dtype == wv.dtype) or xv.dtype not in (torch.float16, torch.bfloat16):
        return False
    others = [u for u in norm.users if u is not x]
    if not all(_is_call(u, operator.getitem) and u.args[1] == 1 for u in others):
        return False
    if not _defined_before(graph, list(lin.args[1:]), norm):
        return False
    target = torch.ops.kbit.linear_add_rms_norm.default
    with graph.inserting_before(norm):
        fused = graph.call_function(target, (x_in, residual, weight, eps, *lin.args[1:]))
        y = graph.call_function(operator.getitem, (fused, 0))
        res = graph.call_function(operator.getitem, (fused, 1))
    _set_fake_val(fused, [y, res])
    lin.replace_all_uses_with(y)
    for u in others:
        u.replace_all_uses_with(res)
    for n in [lin, x, *others, norm]:
        graph.erase_node(n)
    return True


def _silu_input(a: Any) -> Any:
    """s if ``a`` computes silu(s) rounded to s's dtype (the forms aten.silu decomposes into), else
    None."""
    convert = torch.ops.prims.convert_element_type.default
    if _is_call(a, torch.ops.aten.silu.default):
        return a.args[0]
    if not _is_call(a, convert):
        return None
    t = a.args[0]
    s0 = None
    if _is_call(t, torch.ops.aten.silu.default):
        s0 = t.args[0]
    elif _is_call(t, torch.ops.aten.div.Tensor):  # s0 / (exp(-s0) + 1)
        num, den = t.args
        if _is_call(den, torch.ops.aten.add.Tensor) and den.args[1] == 1:
            e = den.args[0]
            if (_is_call(e, torch.ops.aten.exp.default) and _is_call(e.args[0], torch.ops.aten.neg.default)
                    and e.args[0].args[0] is num):  # fmt: skip
                s0 = num
    elif _is_call(t, torch.ops.aten.mul.Tensor):  # s0 * sigmoid(s0)
        p, q = t.args
        if _is_call(q, torch.ops.aten.sigmoid.default) and q.args[0] is p:
            s0 = p
    if s0 is None:
        return None
    if _is_call(s0, convert) and s0.args[1] == torch.float32:
        s = s0.args[0]
        sv, av = _val(s), _val(a)
        if sv is not None and av is not None and sv.dtype == a.args[1] == av.dtype:
            return s
    return None


def _half_of(node: Any, h_node: Any = None) -> tuple[Any, int, int] | None:
    """(h, start, end) if ``node`` is h[:, start:end] on the last dim of a 2-D h."""
    if not _is_call(node, torch.ops.aten.slice.Tensor):
        return None
    h, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else sys.maxsize
    hv = _val(h)
    if hv is None or hv.dim() != 2 or dim not in (1, -1) or (h_node is not None and h is not h_node):
        return None
    return h, start, end


def _fuse_silu(graph: fx.Graph, lin: fx.Node, x: fx.Node) -> bool:
    """kbit.linear(silu(h[:, :d]) * h[:, d:]) -> linear_silu_mul(h)."""
    if not _is_call(x, torch.ops.aten.mul.Tensor) or len(x.users) != 1:
        return False
    for a, b in (x.args, x.args[::-1]):
        s = _silu_input(a)
        gate = _half_of(s)
        if gate is None:
            continue
        h, g0, g1 = gate
        up = _half_of(b, h)
        hv = _val(h)
        d = hv.shape[1] // 2 if isinstance(hv.shape[1], int) else None
        if up is None or d is None or hv.shape[1] != 2 * d or (g0, g1) != (0, d):
            continue
        if up[1] != d or not (up[2] == 2 * d or up[2] >= sys.maxsize):
            continue
        if hv.dtype not in (torch.float16, torch.bfloat16) or hv.dtype != _val(x).dtype:
            continue
        target = torch.ops.kbit.linear_silu_mul.default
        with graph.inserting_before(lin):
            fused = graph.call_function(target, (h, *lin.args[1:]))
        _set_fake_val(fused)
        lin.replace_all_uses_with(fused)
        graph.erase_node(lin)
        # the activation's nodes, now unused (walk back from the product)
        dead, erased = [x], set()
        while dead:
            n = dead.pop()
            if n not in erased and not n.users and n.op == "call_function":
                dead.extend(n.all_input_nodes)
                graph.erase_node(n)
                erased.add(n)
        return True
    return False


def fuse_graph(graph: fx.Graph) -> dict[str, int]:
    """Rewrites every matching kbit.linear of ``graph`` in place; returns the counts."""
    from . import _ops

    _ops.load()
    counts = {"add_rms_norm": 0, "silu_mul": 0}
    linear = torch.ops.kbit.linear.default
    for lin in [n for n in graph.nodes if _is_call(n, linear)]:
        x = _strip_views(lin.args[0])
        if _fuse_norm(graph, lin, x):
            counts["add_rms_norm"] += 1
        elif _fuse_silu(graph, lin, x):
            counts["silu_mul"] += 1
    if any(counts.values()):
        graph.lint()
    return counts


def _make_pass_class() -> type:
    from vllm.compilation.passes.inductor_pass import InductorPass

    class KbitFusionPass(InductorPass):
        """vLLM's ``post_grad_custom_post_pass``: ``fuse_graph``."""

        def __call__(self, graph: fx.Graph) -> None:
            counts = fuse_graph(graph)
            logger.debug("kbit fusion: %s", counts)

        def is_applicable_for_range(self, compile_range: Any) -> bool:
            return compile_range.end <= FUSE_MAX_M

        def uuid(self) -> Any:
            # the compiled graph depends on this file (inductor's and vLLM's cache keys)
            return InductorPass.hash_source(Path(__file__).read_text())

    return KbitFusionPass


_pass_class: type | None = None


def make_pass() -> Any:
    """A KbitFusionPass (a vLLM InductorPass) instance."""
    global _pass_class
    if _pass_class is None:
        _pass_class = _make_pass_class()
    return _pass_class()


def install() -> bool:
    """Adds the pass to the vLLM config being built (from a quant method's constructor, where
    vLLM has set the current config). True when the pass is (already) installed."""
    if not enabled():
        return False
    try:
        from vllm.config import CompilationMode, get_current_vllm_config
    except ImportError:  # vLLM without these names (not 0.26): run unfused
        return False
    cc = get_current_vllm_config().compilation_config
    if cc.mode != CompilationMode.VLLM_COMPILE or _ir_norm_op() is None:
        return False
    current = cc.inductor_compile_config.get(_PASS_KEY)
    if current is not None:
        if type(current).__name__ == "KbitFusionPass":
            return True
        logger.warning("kbit: inductor_compile_config already has a %s (%s); the kbit fusion of "
                       "norm / activation into linear layers is off", _PASS_KEY, current)  # fmt: skip
        return False
    ends = cc.compile_ranges_endpoints
    if not ends:  # no compile ranges: one graph for every size, which the pass leaves alone
        return False
    if FUSE_MAX_M not in ends:
        cc.compile_ranges_endpoints = sorted([*ends, FUSE_MAX_M])
    cc.inductor_compile_config[_PASS_KEY] = make_pass()
    logger.info("kbit: fusing rms_norm and silu_mul into the kbit linear layers that follow them "
                "for batches of <= %d tokens (VLLM_KBIT_FUSION=0 turns this off)", FUSE_MAX_M)  # fmt: skip
    return True
