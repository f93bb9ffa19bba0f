# SPDX-License-Identifier: Apache-2.0
"""Contract tests of torch.ops.kbit.* on the CPU: schemas, fakes (torch.compile), and the
CPU implementations, which are the reference and the plugin's CPU fallback."""

import importlib.metadata
import subprocess
import sys

import pytest
import torch

from vllm_kbit import _ops
from vllm_kbit import reference as ref
from vllm_kbit.format import default_codebook

_ops.load()
OPS = torch.ops.kbit


def _quantized(n: int, k: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    q, a = ref.quantize(w, bits)
    qt, at = ref.repack(q, a, bits)
    return w, q, a, qt, at


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_opcheck_all_ops(bits: int) -> None:
    n, k = 24, 160
    w, q, a, qt, at = _quantized(n, k, bits)
    cb = default_codebook(bits)
    x = torch.randn(3, k, dtype=torch.float16)
    cases = [
        (OPS.quantize, (w.half(), cb, bits)),
        (OPS.dequantize, (q, a, cb, bits, torch.bfloat16)),
        (OPS.repack, (q, a, bits)),
        (OPS.dequantize_tiled, (qt, at, cb, bits, n, k, torch.float16)),
        (OPS.gemv, (x, qt, at, cb, bits, n)),
        (OPS.mma, (x, qt, at, cb, bits, n)),
        (OPS.linear, (x, qt, at, cb, bits, n)),
        (OPS.dense_linear, (x, w.half())),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_cpu_ops_equal_reference() -> None:
    bits, n, k = 3, 40, 4128
    w, q, a, qt, at = _quantized(n, k, bits)
    cb = default_codebook(bits)
    q2, a2 = OPS.quantize(w, cb, bits)
    assert torch.equal(q2, q) and torch.equal(a2, a)
    qt2, at2 = OPS.repack(q, a, bits)
    assert torch.equal(qt2, qt) and torch.equal(at2, at)
    x = torch.randn(5, k, dtype=torch.bfloat16)
    want = ref.linear(x, q, a, cb, bits)
    for op in (OPS.linear, OPS.gemv, OPS.mma):
        assert torch.equal(op(x, qt, at, cb, bits, n), want)
    wb = w.bfloat16()
    assert torch.equal(OPS.dense_linear(x, wb), (x.float() @ wb.float().t()).bfloat16())


@pytest.mark.parametrize(
    "args, msg",
    [
        (lambda x, w: (x.float(), w.float()), "float16 or bfloat16"),
        (lambda x, w: (x, w.bfloat16()), "one dtype"),
        (lambda x, w: (x, w[:, :128]), "K=256 columns"),
        (lambda x, w: (x[0], w), "2-D"),
        (lambda x, w: (x, w[0]), "weight must be 2-D"),
    ],
)
def test_dense_linear_bad_input_names_the_problem(args, msg: str) -> None:
    x, w = torch.randn(2, 256).half(), torch.randn(40, 256).half()
    with pytest.raises((RuntimeError, ValueError), match=msg):
        OPS.dense_linear(*args(x, w))


def test_linear_compiles_once_for_all_batch_sizes() -> None:
    bits, n, k = 4, 32, 256
    _, _, _, qt, at = _quantized(n, k, bits)
    cb = default_codebook(bits)

    def f(x):
        return OPS.linear(x, qt, at, cb, bits, n) * 2

    torch._dynamo.reset()
    cf = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    from torch._dynamo.utils import counters

    counters.clear()
    for m in (5, 7, 33, 100):  # avoid sizes that duck-size onto weight dims
        x = torch.randn(m, k, dtype=torch.float16)
        assert torch.equal(cf(x), f(x))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "args, msg",
    [
        (lambda qt, at, cb: (torch.randn(2, 256), qt, at, cb, 4, 32), "float16 or bfloat16"),
        (lambda qt, at, cb: (torch.randn(2, 256).half(), qt.float(), at, cb, 4, 32), "int32"),
        (lambda qt, at, cb: (torch.randn(2, 256).half(), qt, at.int(), cb, 4, 32), "uint8"),
        (lambda qt, at, cb: (torch.randn(2, 256).half(), qt, at, cb[:8], 4, 32), "codebook"),
        (lambda qt, at, cb: (torch.randn(2, 256).half(), qt, at, cb, 4, 48), "tiled qweight"),
        (lambda qt, at, cb: (torch.randn(256).half(), qt, at, cb, 4, 32), "2-D"),
    ],
)
def test_linear_bad_input_names_the_problem(args, msg: str) -> None:
    _, _, _, qt, at = _quantized(32, 256, 4)
    with pytest.raises((RuntimeError, ValueError), match=msg):
        OPS.linear(*args(qt, at, default_codebook(4)))


def test_register_does_not_initialise_cuda() -> None:
    code = (
        "import torch, vllm_kbit; vllm_kbit.register(); vllm_kbit.register(); "
        "assert hasattr(torch.ops.kbit, 'linear'); "
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_cuda_reference_fills_ops_missing_from_the_extension() -> None:
    """An _C that registers CUDA kernels for some ops only (e.g. built before kbit::moe
    existed): the others get the reference as their CUDA implementation, with a warning."""
    code = (
        "import sys, types, torch\n"
        "fake = types.ModuleType('vllm_kbit._C')\n"
        "fake.lib = torch.library.Library('kbit', 'IMPL')\n"
        "for op in ('quantize', 'dequantize', 'repack', 'dequantize_tiled', 'gemv', 'mma',\n"
        "           'linear', 'linear_add_rms_norm', 'linear_silu_mul', 'dense_linear'):\n"
        "    fake.lib.impl(op, lambda *a: None, 'CUDA')\n"
        "sys.modules['vllm_kbit._C'] = fake\n"
        "from vllm_kbit import _ops\n"
        "assert _ops.load() == 'compiled' and _ops._cuda_reference_ops == ['moe']\n"
        "assert torch._C._dispatch_has_kernel_for_dispatch_key('kbit::moe', 'CUDA')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert "no CUDA kernel for kbit::moe" in out.stderr


def test_entry_point_registered() -> None:
    try:
        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    except Exception:  # pragma: no cover
        pytest.skip("no entry points")
    if not any(d.metadata["Name"] == "vllm-kbit" for d in importlib.metadata.distributions()):
        pytest.skip("vllm-kbit is not installed (running from a source tree)")
    assert any(ep.name == "kbit" and ep.value == "vllm_kbit:register" for ep in eps)
