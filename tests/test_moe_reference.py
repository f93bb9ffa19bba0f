# SPDX-License-Identifier: Apache-2.0
"""``kbit::moe`` on the CPU (the reference, ``reference_moe.moe_tiled``) against an independent
naive MoE: experts dequantized from the checkpoint layout with ``reference.dequantize`` and
every (token, slot) pair computed on its own. Also the op's schema, fake and input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook
from vllm_kbit.reference_moe import moe_tiled

_ops.load()
OPS = torch.ops.kbit
ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}


def make_experts(e: int, h: int, i: int, bits: int, seed: int = 0, std: float = 0.05) -> dict:
    """E random experts: bf16 weights, checkpoint-layout codes and the stacked tiled tensors
    the op takes (row e = ``reference.repack`` of expert e)."""
    g = torch.Generator().manual_seed(seed)
    cb = default_codebook(bits)
    out: dict = {"bits": bits, "codebook": cb, "inter_size": i, "w13": [], "w2": [], "ckpt13": [],
                 "ckpt2": []}  # fmt: skip
    tiled: dict[str, list[torch.Tensor]] = {"q13": [], "a13": [], "q2": [], "a2": []}
    for _ in range(e):
        for name, shape in (("13", (2 * i, h)), ("2", (h, i))):
            w = (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
            q, a = ref.quantize(w, bits, cb)
            qt, at = ref.repack(q, a, bits)
            out["w" + name].append(w)
            out["ckpt" + name].append((q, a))
            tiled["q" + name].append(qt)
            tiled["a" + name].append(at)
    out.update({k: torch.stack(v) for k, v in tiled.items()})
    return out


def op_args(x, ex: dict, topk_weights, topk_ids, expert_map=None, activation="silu",
            on_input=False) -> tuple:  # fmt: skip
    return (x, ex["q13"], ex["a13"], ex["q2"], ex["a2"], ex["codebook"], topk_weights, topk_ids,
            expert_map, ex["bits"], ex["inter_size"], activation, on_input)  # fmt: skip


def naive_moe(x, experts: list[tuple[torch.Tensor, torch.Tensor]], topk_weights, topk_ids,
              expert_map=None, activation="silu", on_input=False) -> torch.Tensor:  # fmt: skip
    """Token by token, slot by slot: experts[e] = (w13 [2I, H], w2 [H, I]) already in x.dtype.
    Same rounding points as the op contract (fp32 products; gate_up and activation rounded
    to x.dtype; fp32 sum over slots rounded once)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            g = int(topk_ids[t, j])
            e = g if expert_map is None else int(expert_map[g])
            if e < 0:
                continue
            w13, w2 = experts[e]
            i = w2.shape[1]
            w = float(topk_weights[t, j])
            h = x[t].float() @ w13.float().t()
            h = (h * w if on_input else h).to(x.dtype)
            a = (ACT[activation](h[:i].float()) * h[i:].float()).to(x.dtype)
            y = a.float() @ w2.float().t()
            out[t] += y if on_input else w * y
    return out.to(x.dtype)


def dequantized_experts(ex: dict, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cb, bits = ex["codebook"], ex["bits"]
    return [(ref.dequantize(*c13, cb, bits, dtype), ref.dequantize(*c2, cb, bits, dtype))
            for c13, c2 in zip(ex["ckpt13"], ex["ckpt2"], strict=True)]  # fmt: skip


def routing(t: int, n_global: int, topk: int, seed: int = 0, ids_dtype=torch.int32):
    """Random distinct experts per token and softmax-renormalised weights (float32)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_global, generator=g)[:topk] for _ in range(t)]) if t else \
        torch.empty(0, topk, dtype=torch.int64)  # fmt: skip
    w = torch.rand(t, topk, generator=g) + 0.1
    return (w / w.sum(1, keepdim=True)).float(), ids.to(ids_dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    # The op batches tokens per expert, the naive sum goes row by row: fp32 sums may differ
    # in order, and an intermediate rounding to 16 bits can then flip by one ulp.
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * scale + 1e-6)


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("e,topk,t", [(1, 1, 5), (3, 2, 7), (8, 2, 1), (8, 4, 17), (4, 2, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_matches_naive(e, topk, t, dtype):
    h, i, bits = 160, 96, 4  # H=160: K padded to 256 in the tiled layout of w13
    ex = make_experts(e, h, i, bits, seed=e)
    x = torch.randn(t, h).to(dtype)
    tw, ids = routing(t, e, topk, seed=t)
    got = OPS.moe(*op_args(x, ex, tw, ids))
    want = naive_moe(x, dequantized_experts(ex, dtype), tw, ids)
    assert_matches(got, want)
    if t:
        assert got.abs().max() > 0


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bits", [2, 3, 5])
def test_activations_and_bits(activation, bits):
    e, h, i = 4, 64, 32
    ex = make_experts(e, h, i, bits, seed=bits)
    x = torch.randn(6, h).to(torch.bfloat16)
    tw, ids = routing(6, e, 2, seed=1, ids_dtype=torch.int64)
    got = OPS.moe(*op_args(x, ex, tw, ids, activation=activation))
    assert_matches(got, naive_moe(x, dequantized_experts(ex, x.dtype), tw, ids,
                                  activation=activation))  # fmt: skip


def test_empty_experts_and_int32_int64_ids_agree():
    ex = make_experts(16, 64, 64, 3, seed=5)
    x = torch.randn(2, 64).to(torch.float16)
    tw, ids = routing(2, 16, 2, seed=3)  # 2 tokens x 2 slots: at least 12 experts get nothing
    a = OPS.moe(*op_args(x, ex, tw, ids.int()))
    b = OPS.moe(*op_args(x, ex, tw, ids.long()))
    assert torch.equal(a, b)
    assert_matches(a, naive_moe(x, dequantized_experts(ex, x.dtype), tw, ids))


def test_expert_map_skips_other_ranks_experts():
    """EP: 6 global experts, 3 on this rank (global 1, 3, 4 -> local 0, 2, 1)."""
    ex = make_experts(3, 64, 32, 4, seed=7)
    expert_map = torch.tensor([-1, 0, -1, 2, 1, -1], dtype=torch.int32)
    x = torch.randn(9, 64).to(torch.bfloat16)
    tw, ids = routing(9, 6, 3, seed=2)
    got = OPS.moe(*op_args(x, ex, tw, ids, expert_map=expert_map))
    want = naive_moe(x, dequantized_experts(ex, x.dtype), tw, ids, expert_map=expert_map)
    assert_matches(got, want)
    # the same as running all 6 experts with the non-local ones' weights set to zero
    local = [int(expert_map[g]) for g in range(6)]
    zero = (torch.zeros_like(ex["w13"][0]), torch.zeros_like(ex["w2"][0]))
    full = [dequantized_experts(ex, x.dtype)[j] if j >= 0 else zero for j in local]
    assert_matches(got, naive_moe(x, full, tw, ids))
    only_remote = torch.tensor([[0, 2, 5]] * 9, dtype=torch.int32)  # no local expert: zeros
    assert not OPS.moe(*op_args(x, ex, tw, only_remote, expert_map=expert_map)).any()


def test_apply_router_weight_on_input():
    ex = make_experts(4, 64, 32, 4, seed=9)
    x = torch.randn(5, 64).to(torch.bfloat16)
    tw, ids = routing(5, 4, 1, seed=4)
    tw = tw * torch.rand(5, 1)  # topk=1 weights after renormalising are 1: make them vary
    got = OPS.moe(*op_args(x, ex, tw, ids, on_input=True))
    experts = dequantized_experts(ex, x.dtype)
    assert_matches(got, naive_moe(x, experts, tw, ids, on_input=True))
    # silu is not linear: scaling the input is not the same as scaling the output
    assert not torch.allclose(got.float(), naive_moe(x, experts, tw, ids).float(), rtol=1e-2)


def test_tiled_reference_equals_direct_call():
    ex = make_experts(3, 64, 32, 2, seed=1)
    x = torch.randn(4, 64).to(torch.bfloat16)
    tw, ids = routing(4, 3, 2)
    assert torch.equal(OPS.moe(*op_args(x, ex, tw, ids)), moe_tiled(*op_args(x, ex, tw, ids)))


# ------------------------------------------------------------------- schema, fake, errors


def test_opcheck_and_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ex = make_experts(3, 64, 32, 4)
    tw, ids = routing(5, 6, 2)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1], dtype=torch.int32)
    for t, em, on_input in ((5, None, False), (5, expert_map, False), (0, None, False)):
        x = torch.randn(t, 64).to(torch.bfloat16)
        w, i = tw[:t], (ids[:t] % 3 if em is None else ids[:t])
        torch.library.opcheck(OPS.moe, op_args(x, ex, w, i, expert_map=em, on_input=on_input))
    x1, (w1, i1) = torch.randn(5, 64).half(), routing(5, 3, 1)
    torch.library.opcheck(OPS.moe, op_args(x1, ex, w1, i1, on_input=True))
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                for a in op_args(torch.randn(7, 64).half(), ex, *routing(7, 3, 2))]  # fmt: skip
        out = OPS.moe(*args)
    assert out.shape == (7, 64) and out.dtype == torch.float16


def _bad(kind: str, args: list) -> list:
    """Break one argument of a valid op call (positions as in the schema)."""
    (x, q13, a13, q2, a2, cb, tw, ids, em, bits, inter, act, on_input) = args
    changes = {
        "x_dtype": (0, x.float()),
        "x_dim": (0, x[0]),
        "x_hidden": (0, x[:, :48]),
        "q13_dtype": (1, q13.view(torch.float32)),
        "q13_shape": (1, q13[:, :-4]),
        "a13_dtype": (2, a13.to(torch.int32)),
        "q2_experts": (3, q2[:2]),
        "a2_shape": (4, a2[:, 1:]),
        "codebook": (5, cb[:8]),
        "topk_weights_dtype": (6, tw.half()),
        "topk_weights_rows": (6, tw[:2]),
        "topk_ids_dtype": (7, ids.to(torch.int16)),
        "topk_ids_shape": (7, ids[:, :1]),
        "ids_out_of_range": (7, ids + 10),
        "expert_map_dtype": (8, torch.zeros(3, dtype=torch.int64)),
        "expert_map_target": (8, torch.tensor([0, 1, 7], dtype=torch.int32)),
        "bits": (9, 6),
        "inter_size": (10, 64),
        "inter_size_odd": (10, 48),
        "activation": (11, "relu2"),
        "on_input_topk2": (12, True),
    }
    pos, value = changes[kind]
    args = list(args)
    args[pos] = value
    return args


# (kind, the error message it must give): one bad argument each, built by _bad
BAD_INPUTS = [
    ("x_dtype", "x must be float16 or bfloat16"), ("x_dim", r"x must be 2-D"),
    ("x_hidden", "hidden size 48"), ("q13_dtype", "w13_qweight must be torch.int32"),
    ("q13_shape", r"w13_qweight must be .*\[E, 1024\]"), ("a13_dtype", "w13_absmax must be"),
    ("q2_experts", r"w2_qweight must be .*E=3"), ("a2_shape", "w2_absmax must be"),
    ("codebook", r"codebook must be float32 \[16\]"), ("topk_weights_dtype", "topk_weights must"),
    ("topk_weights_rows", r"topk_weights must be float32 \[T=4"),
    ("topk_ids_dtype", "topk_ids must be int32 or int64"), ("topk_ids_shape", "topk_ids must"),
    ("ids_out_of_range", r"topk_ids must lie in \[0, 3\)"),
    ("expert_map_dtype", "expert_map must be int32"),
    ("expert_map_target", "maps to local expert 7"), ("bits", "bits must be one of"),
    ("inter_size", "w13_qweight must be"), ("inter_size_odd", "inter_size must be a positive"),
    ("activation", "activation must be one of"),
    ("on_input_topk2", "apply_router_weight_on_input needs topk == 1"),
]  # fmt: skip


@pytest.mark.parametrize("kind,msg", BAD_INPUTS)
def test_bad_input_names_the_problem(kind, msg):
    ex = make_experts(3, 64, 32, 4)
    x = torch.randn(4, 64).to(torch.bfloat16)
    args = list(op_args(x, ex, *routing(4, 3, 2)))
    with pytest.raises(ValueError, match=msg):
        OPS.moe(*_bad(kind, args))
