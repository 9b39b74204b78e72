// The Python module `compactionrl_fast._C`. The op schemas are defined in csrc/schemas.cpp (TORCH_LIBRARY)
// and each device file registers its kernels (TORCH_LIBRARY_IMPL); importing this module loads them.
// MODES: the mode codes compiled in (csrc/common/modes.h), {group: {name: code}}, checked against
// kernels/modes.py by tests/test_modes.py.
#include <Python.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/modes.h"

namespace crf {
std::vector<int64_t> cpu_output_cache(int64_t limit, bool clear);  // csrc/cpu/output_cache.cpp
std::string cpu_simd(const char* name);                            // csrc/cpu/gae.cpp
}

// output_cache(limit, clear) -> (cached bytes, limit bytes, hits, misses); limit < 0 keeps the limit.
static PyObject* output_cache(PyObject*, PyObject* args) {
  long long limit = -1;
  int clear = 0;
  if (!PyArg_ParseTuple(args, "Lp", &limit, &clear)) return nullptr;
  std::vector<int64_t> s = crf::cpu_output_cache(limit, clear != 0);
  return Py_BuildValue("(LLLL)", (long long)s[0], (long long)s[1], (long long)s[2], (long long)s[3]);
}

// cpu_simd(name=None) -> the CPU segment_gae scan's SIMD path in force ("auto", "avx512", "avx2", "none");
// a name sets it (it replaces COMPACTIONRL_FAST_CPU_SIMD). A bad name is a ValueError.
static PyObject* cpu_simd(PyObject*, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "|z", &name)) return nullptr;
  try {
    return PyUnicode_FromString(crf::cpu_simd(name).c_str());
  } catch (const std::exception& e) {  // c10::ValueError
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
}

static PyObject* modes_dict() {
  PyObject* out = PyDict_New();
  auto add = [&](const char* group, const char* name, int64_t code) {
    PyObject* g = PyDict_GetItemString(out, group);  // borrowed
    if (g == nullptr) {
      g = PyDict_New();
      PyDict_SetItemString(out, group, g);
      Py_DECREF(g);
    }
    PyObject* v = PyLong_FromLongLong(code);
    PyDict_SetItemString(g, name, v);
    Py_DECREF(v);
  };
#define CRF_ADD_MODE(group, name, code) add(group, name, code);
  CRF_MODES(CRF_ADD_MODE)
#undef CRF_ADD_MODE
  return out;
}

static PyMethodDef crf_methods[] = {
    {"output_cache", output_cache, METH_VARARGS, "output_cache(limit, clear) -> (cached, limit, hits, misses)"},
    {"cpu_simd", cpu_simd, METH_VARARGS, "cpu_simd(name=None) -> the CPU GAE scan's SIMD path in force"},
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
  PyModule_AddObject(m, "MODES", modes_dict());
  return m;
}
