# SPDX-License-Identifier: Apache-2.0
"""Diagnose C++ exceptions thrown from an extension: build two tiny extensions (g++ and nvcc)
whose ops throw, call them, and print the toolchain. Run as: python3 tools/exc_diag.py"""
import subprocess
import sys

import torch
from torch.utils.cpp_extension import load_inline

print("python", sys.version.split()[0], "torch", torch.__version__, "abi",
      torch._C._GLIBCXX_USE_CXX11_ABI, flush=True)
for cmd in (["c++", "--version"], ["nvcc", "--version"]):
    try:
        print(subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0:1], flush=True)
    except Exception as e:
        print(cmd, e)
src = r'''
#include <torch/all.h>
at::Tensor f_{tag}(const at::Tensor& x){{ TORCH_CHECK(x.dim() == 7, "plain check ", x.sizes()); return x; }}
TORCH_LIBRARY(exc_{tag}, m){{ m.def("f(Tensor x) -> Tensor"); }}
TORCH_LIBRARY_IMPL(exc_{tag}, CompositeExplicitAutograd, m){{ m.impl("f", &f_{tag}); }}
'''
for tag, kw in (("gxx", {"cpp_sources": [src.format(tag="gxx")]}),
                ("nvcc", {"cpp_sources": [""], "cuda_sources": [src.format(tag="nvcc")]})):
    load_inline(f"exc_{tag}", is_python_module=False, verbose=tag == "nvcc", **kw)
    print("calling", tag, flush=True)
    try:
        getattr(torch.ops, f"exc_{tag}").f(torch.zeros(2))
    except Exception as e:
        print(tag, "caught", type(e).__name__, str(e)[:60], flush=True)
