// SPDX-License-Identifier: Apache-2.0
// Registers the CUDA implementations of the kbit ops. The schemas (and the CPU reference
// implementations and fakes) are defined in vllm_kbit/_ops.py, which imports this module.
#include <Python.h>

#include <cstdlib>
#include <string_view>

#include "ops.h"

TORCH_LIBRARY_IMPL(kbit, CUDA, m) {
    m.impl("quantize", &kbit::quantize);
    m.impl("dequantize", &kbit::dequantize);
    m.impl("repack", &kbit::repack);
    m.impl("dequantize_tiled", &kbit::dequantize_tiled);
    m.impl("gemv", &kbit::gemv);
    m.impl("mma", &kbit::mma);
    m.impl("linear", &kbit::linear);
}

// kbit::moe's CUDA kernel (moe.cu) is opt-in until it passes tests/test_cuda_moe.py on a GPU:
// registered only when KBIT_MOE_KERNEL=1 is set as vllm_kbit._C is imported. Otherwise
// vllm_kbit._ops serves CUDA tensors with the pure-PyTorch reference (correct, slow, host sync).
static const bool kbit_moe_kernel_registered = [] {
    const char* v = std::getenv("KBIT_MOE_KERNEL");
    if (v == nullptr || std::string_view(v) != "1") return false;
    static torch::Library lib(torch::Library::IMPL, "kbit", c10::DispatchKey::CUDA, __FILE__,
                              __LINE__);
    lib.impl("moe", &kbit::moe);
    return true;
}();

// An empty Python module: importing vllm_kbit._C only loads the library above.
static struct PyModuleDef kbit_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kbit_module); }
