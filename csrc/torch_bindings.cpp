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
    m.impl("linear_add_rms_norm", &kbit::linear_add_rms_norm);
    m.impl("linear_silu_mul", &kbit::linear_silu_mul);
    m.impl("dense_linear", &kbit::dense_linear);
}

// kbit::moe's CUDA kernel (moe.cu). Escape hatch: KBIT_MOE_REFERENCE=1 set as vllm_kbit._C is
// imported leaves it unregistered, so that vllm_kbit._ops serves CUDA tensors with the
// pure-PyTorch reference (correct, slow, host sync: no CUDA graphs).
static const bool kbit_moe_kernel_registered = [] {
    const char* v = std::getenv("KBIT_MOE_REFERENCE");
    if (v != nullptr && std::string_view(v) == "1") return false;
    static torch::Library lib(torch::Library::IMPL, "kbit", c10::DispatchKey::CUDA, __FILE__,
                              __LINE__);
    lib.impl("moe", &kbit::moe);
    return true;
}();

// A Python module whose import loads the library above; `sm90a` = 1 when the build has sm_90a
// code (the kbit::mma wgmma path can run on sm_90 GPUs; setup.py, TORCH_CUDA_ARCH_LIST 9.0a).
static struct PyModuleDef kbit_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) {
    PyObject* m = PyModule_Create(&kbit_module);
#if defined(KBIT_SM90A)
    const long sm90a = 1;
#else
    const long sm90a = 0;
#endif
    if (m != nullptr && PyModule_AddIntConstant(m, "sm90a", sm90a) != 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
