# SPDX-License-Identifier: Apache-2.0
"""Codebook fitting (regenerates the defaults), the normal-float codebook, sqnr()."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from vllm_kbit.codebook import fit_codebook, nf_codebook, sqnr
from vllm_kbit.format import SUPPORTED_BITS, check_codebook, default_codebook


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_fit_codebook_reproduces_the_defaults(bits):
    cb = fit_codebook(bits)  # 4M samples, seed 0: how the defaults were made
    assert cb.dtype == torch.float32 and cb.shape == (2**bits,)
    # the defaults are those values rounded to bf16 (<= 2^-9 relative)
    assert float((cb - default_codebook(bits)).abs().max()) < 1e-3 + 2**-9


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_fit_codebook_properties(bits):
    cb = fit_codebook(bits, n=1 << 16, seed=1, iters=50)
    check_codebook(cb, bits)  # sorted, finite, in [-1, 1]
    assert torch.equal(cb, -cb.flip(0))  # exactly symmetric
    assert bool((cb[1:] > cb[:-1]).all())


def test_fit_codebook_is_deterministic_and_seeded():
    a, b = fit_codebook(3, n=1 << 15, seed=3), fit_codebook(3, n=1 << 15, seed=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, fit_codebook(3, n=1 << 15, seed=4))


@pytest.mark.parametrize("kwargs", [{"bits": 6}, {"bits": 4, "n": 31}, {"bits": 4, "n": 100}])
def test_fit_codebook_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        fit_codebook(**kwargs)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_nf_codebook(bits):
    cb = nf_codebook(bits)
    check_codebook(cb, bits)
    size = 2**bits
    top = NormalDist().inv_cdf((size - 0.5) / size)
    expect = [NormalDist().inv_cdf((i + 0.5) / size) / top for i in range(size)]
    assert cb.tolist() == pytest.approx(expect, abs=1e-7)
    assert cb[-1] == 1.0 and cb[0] == -1.0
    assert torch.allclose(cb, -cb.flip(0))


def test_nf_codebook_known_values():
    assert nf_codebook(2).tolist() == pytest.approx([-1, -0.276994, 0.276994, 1], abs=1e-6)


def test_sqnr():
    x = torch.tensor([3.0, 4.0])
    assert sqnr(x, x) == math.inf
    assert sqnr(torch.zeros(3), torch.zeros(3)) == math.inf
    assert sqnr(torch.zeros(3), torch.ones(3)) == -math.inf
    assert sqnr(x, torch.tensor([3.0, 4.5])) == pytest.approx(10 * math.log10(25 / 0.25))
    assert sqnr(x.half(), torch.tensor([3.0, 4.5]).bfloat16()) == pytest.approx(20.0)
