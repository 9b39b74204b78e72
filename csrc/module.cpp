// The Python module `compactionrl_fast._C`. The op schemas are defined in csrc/schemas.cpp (TORCH_LIBRARY)
// and each device file registers its kernels (TORCH_LIBRARY_IMPL); importing this module loads them.
#include <Python.h>

static struct PyModuleDef crf_module = {PyModuleDef_HEAD_INIT, "_C", "compactionrl_fast C++/CUDA ops", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&crf_module);
  if (m == nullptr) return nullptr;
#ifdef CRF_WITH_CUDA
  PyModule_AddIntConstant(m, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "WITH_CUDA", 0);
#endif
  return m;
}
