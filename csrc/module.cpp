// The Python module `compactionrl_fast._C`. The op schemas are defined in csrc/schemas.cpp (TORCH_LIBRARY)
// and each device file registers its kernels (TORCH_LIBRARY_IMPL); importing this module loads them.
#include <Python.h>

#include <cstdint>
#include <vector>

namespace crf {
std::vector<int64_t> cpu_output_cache(int64_t limit, bool clear);  // csrc/cpu/output_cache.cpp
}

// output_cache(limit, clear) -> (cached bytes, limit bytes, hits, misses); limit < 0 keeps the limit.
static PyObject* output_cache(PyObject*, PyObject* args) {
  long long limit = -1;
  int clear = 0;
  if (!PyArg_ParseTuple(args, "Lp", &limit, &clear)) return nullptr;
  std::vector<int64_t> s = crf::cpu_output_cache(limit, clear != 0);
  return Py_BuildValue("(LLLL)", (long long)s[0], (long long)s[1], (long long)s[2], (long long)s[3]);
}

static PyMethodDef crf_methods[] = {
    {"output_cache", output_cache, METH_VARARGS, "output_cache(limit, clear) -> (cached, limit, hits, misses)"},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef crf_module = {PyModuleDef_HEAD_INIT, "_C", "compactionrl_fast C++/CUDA ops", -1,
                                        crf_methods};

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
