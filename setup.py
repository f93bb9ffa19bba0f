# SPDX-License-Identifier: Apache-2.0
"""Builds the CUDA extension ``vllm_kbit._C`` when nvcc is available.

Knobs: KBIT_SKIP_CUDA_BUILD=1 (pure-Python install), TORCH_CUDA_ARCH_LIST (default
"8.0;8.9;9.0a": 9.0a = sm_90 plus its arch-specific instructions, wgmma, which the kbit::mma
wgmma path needs; a plain "9.0" builds everything else), MAX_JOBS (parallel nvcc jobs),
NVCC_THREADS, KBIT_DEBUG=1 (-O0 -g -lineinfo).
"""

import glob
import os
import shutil

from setuptools import setup


def cuda_extensions():
    if os.environ.get("KBIT_SKIP_CUDA_BUILD", "0") == "1":
        print("vllm-kbit: KBIT_SKIP_CUDA_BUILD=1, installing the pure-Python package")
        return [], {}
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and shutil.which("nvcc"):
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc"))))
    if not cuda_home and os.path.exists("/usr/local/cuda/bin/nvcc"):
        cuda_home = "/usr/local/cuda"
    if not cuda_home:
        print("vllm-kbit: no nvcc found, installing the pure-Python package (CPU reference ops)")
        return [], {}
    os.environ.setdefault("CUDA_HOME", cuda_home)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;8.9;9.0a")
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(",", ";").replace(" ", ";").split(";")
    # host code learns that the fatbin has sm_90a SASS (csrc/mma.cu, vllm_kbit._C.sm90a)
    sm90a = ["-DKBIT_SM90A"] if any(a.startswith("9.0a") for a in archs) else []
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    debug = os.environ.get("KBIT_DEBUG", "0") == "1"
    opt = ["-O0", "-g", "-lineinfo"] if debug else ["-O3", "-lineinfo"]
    nvcc = opt + [
        "-std=c++17",
        "--expt-relaxed-constexpr",
        "-Xptxas=--warn-on-spills",
        f"--threads={os.environ.get('NVCC_THREADS', '2')}",
        "-DNDEBUG" if not debug else "-DKBIT_DEBUG",
        # torch's builder defines these to hide half/bf16 operators; the kernels use them.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        *sm90a,
    ]
    ext = CUDAExtension(
        name="vllm_kbit._C",
        sources=sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu")),
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": opt + ["-std=c++17", *sm90a], "nvcc": nvcc},
        py_limited_api=False,
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
