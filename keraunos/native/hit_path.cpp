// The native hit path of keraunos.jit: one C call that checks what the Python hit path of a
// simple entry checks, then runs its computation. keraunos/native/__init__.py says which entries
// it serves and why it accepts exactly the calls their Python hit path accepts.
//
// Two types:
//   Hit    what one entry's prologue checks: the argument count (no keywords), dynamo's
//          GlobalStateGuard and TensorGuards objects of the prologue itself (their own C
//          functions are called, so they compare exactly what the prologue's calls compare), and
//          the ambient settings the prologue compares in Python (autocast dtypes, float32 matmul
//          precision), which are read here from the same C++ getters torch's bindings read.
//          Those two guards cost 2.7k instructions a call (GlobalStateGuard asks every device
//          type whether autocast is on, TensorGuards builds a set to find duplicates), so the
//          first call they accept also records the values they depend on (``Armed``); a later
//          call whose values are all the same is accepted without them, and any other call is
//          decided by the guards themselves again.
//   Front  a jitted function's ``__call__``: a method descriptor (so ``jitted(x)`` reaches it
//          with no Python frame) that runs the front entry's Hit, and otherwise calls the
//          Python ``__call__`` it was given, which explains misses and compiles.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Export.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <utility>
#include <vector>

// As ATen/autocast_mode.h declares it; that header costs seconds of compile time.
namespace at::autocast {
TORCH_API at::ScalarType get_autocast_dtype(at::DeviceType device_type);
TORCH_API bool is_autocast_cache_enabled();
}

namespace {

PyObject* computation_fn_name = nullptr;  // interned "computation_fn"

// ---------------------------------------------------------------------------------- Armed
// What GlobalStateGuard's and TensorGuards' checks depend on, read when both accepted a call.
// Equal values now mean both would accept again: GlobalStateGuard compares grad mode, autocast
// (on or off per device type: the thread's excluded dispatch keys; its dtype only where on, and
// nothing is armed while any is on; its cast cache), torch function's state, deterministic
// algorithms and warn-only, the cuBLAS TF32 precision and reduced-precision options, the thread
// count and the default dtype; TensorGuards compares each tensor's Python type, its dispatch
// keys as the thread's included and excluded keys modify them (nothing is armed where a Python
// key takes part: its masking then depends on a dispatch mode), dtype, device index,
// requires_grad, sizes and strides.
struct TensorMeta {
  PyTypeObject* type;
  uint64_t keys;
  caffe2::TypeMeta dtype;
  c10::Device device = c10::Device(c10::kCPU);
  bool requires_grad;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

struct GlobalValues {
  bool grad_mode;
  uint64_t included, excluded;
  at::impl::TorchFunctionDisabledState torch_function;
  bool deterministic, warn_only, autocast_cache;
  at::Float32Precision cublas_matmul;
  at::CuBLASReductionOption fp16_reduce, bf16_reduce;
  int num_threads;
  caffe2::TypeMeta default_dtype;

  static GlobalValues now() {
    auto& ctx = at::globalContext();
    auto local = c10::impl::tls_local_dispatch_key_set();
    return {c10::GradMode::is_enabled(),
            local.included_.raw_repr(),
            local.excluded_.raw_repr(),
            at::impl::PythonTorchFunctionTLS::get_disabled_state(),
            ctx.deterministicAlgorithms(),
            ctx.deterministicAlgorithmsWarnOnly(),
            at::autocast::is_autocast_cache_enabled(),
            ctx.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL),
            ctx.allowFP16ReductionCuBLAS(),
            ctx.allowBF16ReductionCuBLAS(),
            at::get_num_threads(),
            c10::get_default_dtype()};
  }

  bool operator==(const GlobalValues& o) const {
    return grad_mode == o.grad_mode && included == o.included && excluded == o.excluded &&
        torch_function == o.torch_function && deterministic == o.deterministic &&
        warn_only == o.warn_only && autocast_cache == o.autocast_cache &&
        cublas_matmul == o.cublas_matmul && fp16_reduce == o.fp16_reduce &&
        bf16_reduce == o.bf16_reduce && num_threads == o.num_threads &&
        default_dtype == o.default_dtype;
  }
};

const c10::DispatchKeySet python_keys({c10::DispatchKey::Python,
                                       c10::DispatchKey::PythonTLSSnapshot,
                                       c10::DispatchKey::PythonDispatcher});

struct Armed {
  GlobalValues global;
  std::vector<TensorMeta> tensors;

  // Whether the values of this call can be armed: no autocast on, no Python key.
  static bool armable(const GlobalValues& g) {
    auto excluded = c10::DispatchKeySet(c10::DispatchKeySet::RAW, g.excluded);
    auto included = c10::DispatchKeySet(c10::DispatchKeySet::RAW, g.included);
    return (excluded & c10::autocast_dispatch_keyset) == c10::autocast_dispatch_keyset &&
        (included & python_keys).empty();
  }

  // The tensor's values; false where they cannot be read as plain sizes and strides.
  static bool read(PyObject* item, TensorMeta& meta) {
    if (!THPVariable_Check(item)) return false;
    const auto* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
    if (impl->layout() != c10::kStrided || impl->is_nested() ||
        impl->has_symbolic_sizes_strides() || !(impl->key_set() & python_keys).empty()) {
      return false;
    }
    meta.type = Py_TYPE(item);
    meta.keys = impl->key_set().raw_repr();
    meta.dtype = impl->dtype();
    meta.device = impl->device();
    meta.requires_grad = impl->requires_grad();
    auto sizes = impl->sizes();
    auto strides = impl->strides();
    meta.sizes.assign(sizes.begin(), sizes.end());
    meta.strides.assign(strides.begin(), strides.end());
    return true;
  }

  bool same_tensors(PyObject* const* args) const {
    for (size_t i = 0; i < tensors.size(); i++) {
      const TensorMeta& meta = tensors[i];
      PyObject* item = args[i];
      if (Py_TYPE(item) != meta.type) return false;
      const auto* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
      if (impl->key_set().raw_repr() != meta.keys || impl->dtype() != meta.dtype ||
          impl->device() != meta.device || impl->requires_grad() != meta.requires_grad) {
        return false;
      }
      auto sizes = impl->sizes();
      auto strides = impl->strides();
      if (sizes.size() != meta.sizes.size() ||
          !std::equal(sizes.begin(), sizes.end(), meta.sizes.begin()) ||
          !std::equal(strides.begin(), strides.end(), meta.strides.begin())) {
        return false;
      }
    }
    return true;
  }
};

// ------------------------------------------------------------------------------------ Hit
struct Hit {
  PyObject_HEAD
  PyObject* entry;          // the CacheEntry
  PyObject* entry_dict;     // its __dict__: computation_fn read from it on every call (tiers)
  Py_ssize_t nargs;
  PyObject* global_guard;   // GlobalStateGuard
  PyCFunction global_check;
  PyObject* tensor_guards;  // TensorGuards
  PyCFunctionWithKeywords tensor_check;
  std::vector<std::pair<c10::DeviceType, c10::ScalarType>>* autocast_dtypes;
  int matmul_precision;     // at::Float32MatmulPrecision as an int; -1: not checked
  Armed* armed;             // null until the guards accept a call whose values can be armed
};

// The C function behind ``obj.<name>``, a method of a C type with the calling convention
// ``flags``: the hit calls it as the prologue's ``obj.<name>(...)`` would, without the lookup.
void* c_method(PyObject* obj, const char* name, int flags) {
  PyObject* method = PyObject_GetAttrString(obj, name);
  if (method == nullptr) return nullptr;
  void* fn = nullptr;
  if (PyCFunction_Check(method) && PyCFunction_GET_SELF(method) == obj &&
      PyCFunction_GET_FLAGS(method) == flags) {
    fn = (void*)PyCFunction_GET_FUNCTION(method);
  } else {
    PyErr_Format(PyExc_TypeError, "%R.%s is not a C method with the expected calling convention",
                 obj, name);
  }
  Py_DECREF(method);
  return fn;
}

int Hit_init(Hit* self, PyObject* args, PyObject* kwargs) {
  PyObject *entry, *global_guard, *tensor_guards, *autocast;
  Py_ssize_t nargs;
  int matmul_precision;
  if (!PyArg_ParseTuple(args, "OnOOO!i", &entry, &nargs, &global_guard, &tensor_guards,
                        &PyTuple_Type, &autocast, &matmul_precision)) {
    return -1;
  }
  auto global_check = (PyCFunction)c_method(global_guard, "check", METH_NOARGS);
  if (global_check == nullptr) return -1;
  auto tensor_check = (PyCFunctionWithKeywords)c_method(tensor_guards, "check",
                                                        METH_VARARGS | METH_KEYWORDS);
  if (tensor_check == nullptr) return -1;
  auto dtypes = new std::vector<std::pair<c10::DeviceType, c10::ScalarType>>();
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(autocast); i++) {
    PyObject* item = PyTuple_GET_ITEM(autocast, i);
    const char* device;
    PyObject* dtype;
    if (!PyArg_ParseTuple(item, "sO", &device, &dtype) || !THPDtype_Check(dtype)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected (device type, dtype)");
      delete dtypes;
      return -1;
    }
    try {
      dtypes->emplace_back(c10::Device(device).type(), ((THPDtype*)dtype)->scalar_type);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
      delete dtypes;
      return -1;
    }
  }
  // The instance dict itself (made now where attributes are kept inline), read on every call:
  // a tier switch sets the entry's computation_fn there (CacheEntry has no slot or descriptor
  // for it).
  PyObject* entry_dict = PyObject_GenericGetDict(entry, nullptr);
  if (entry_dict == nullptr) {
    delete dtypes;
    return -1;
  }
  Py_XSETREF(self->entry_dict, entry_dict);
  Py_INCREF(entry);
  Py_INCREF(global_guard);
  Py_INCREF(tensor_guards);
  Py_XSETREF(self->entry, entry);
  Py_XSETREF(self->global_guard, global_guard);
  Py_XSETREF(self->tensor_guards, tensor_guards);
  delete self->autocast_dtypes;
  self->autocast_dtypes = dtypes;
  self->nargs = nargs;
  self->global_check = global_check;
  self->tensor_check = tensor_check;
  self->matmul_precision = matmul_precision;
  delete self->armed;
  self->armed = nullptr;
  return 0;
}

int Hit_traverse(Hit* self, visitproc visit, void* arg) {
  Py_VISIT(self->entry);
  Py_VISIT(self->entry_dict);
  Py_VISIT(self->global_guard);
  Py_VISIT(self->tensor_guards);
  return 0;
}

int Hit_clear(Hit* self) {
  Py_CLEAR(self->entry);
  Py_CLEAR(self->entry_dict);
  Py_CLEAR(self->global_guard);
  Py_CLEAR(self->tensor_guards);
  return 0;
}

void Hit_dealloc(Hit* self) {
  PyObject_GC_UnTrack(self);
  Hit_clear(self);
  delete self->autocast_dtypes;
  delete self->armed;
  Py_TYPE(self)->tp_free((PyObject*)self);
}

PyObject* Hit_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  Hit* self = (Hit*)type->tp_alloc(type, 0);
  if (self != nullptr) {
    self->autocast_dtypes = nullptr;
    self->matmul_precision = -1;
    self->armed = nullptr;
  }
  return (PyObject*)self;
}

// The settings the prologue compares in Python, read from the getters behind its calls.
bool Hit_python_settings_match(Hit* self) {
  for (const auto& [device_type, dtype] : *self->autocast_dtypes) {
    if (at::autocast::get_autocast_dtype(device_type) != dtype) return false;
  }
  if (self->matmul_precision >= 0) {
    try {
      if ((int)at::globalContext().float32MatmulPrecision() != self->matmul_precision) {
        return false;
      }
    } catch (...) {  // precisions set per backend: torch's getter raises, and so does the prologue
      return false;
    }
  }
  return true;
}

// GlobalStateGuard and TensorGuards, called as the prologue calls them. ``tuple``: the
// arguments as a tuple, when the caller has one.
bool Hit_guards_accept(Hit* self, PyObject* const* args, Py_ssize_t nargs, PyObject* tuple) {
  PyObject* ok = self->global_check(self->global_guard, nullptr);
  if (ok != Py_True) {
    Py_XDECREF(ok);
    PyErr_Clear();
    return false;
  }
  Py_DECREF(ok);
  PyObject* tensors = tuple;
  if (tensors == nullptr) {
    tensors = PyTuple_New(nargs);
    if (tensors == nullptr) {
      PyErr_Clear();
      return false;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(tensors, i, args[i]);
    }
  } else {
    Py_INCREF(tensors);
  }
  ok = self->tensor_check(self->tensor_guards, tensors, nullptr);
  Py_DECREF(tensors);
  if (ok != Py_True) {
    Py_XDECREF(ok);
    PyErr_Clear();
    return false;
  }
  Py_DECREF(ok);
  return true;
}

void Hit_arm(Hit* self, PyObject* const* args, Py_ssize_t nargs, const GlobalValues& global) {
  if (!Armed::armable(global)) return;
  auto armed = new Armed{global, std::vector<TensorMeta>(nargs)};
  for (Py_ssize_t i = 0; i < nargs; i++) {
    if (!Armed::read(args[i], armed->tensors[i])) {
      delete armed;
      return;
    }
  }
  self->armed = armed;
}

// Whether the entry's checks accept these positional arguments. Nothing raises here: where
// anything fails, the Python hit path decides (and explains).
bool Hit_accepts(Hit* self, PyObject* const* args, Py_ssize_t nargs, PyObject* tuple = nullptr) {
  if (nargs != self->nargs || !Hit_python_settings_match(self)) return false;
  try {
    GlobalValues global = GlobalValues::now();
    if (self->armed != nullptr && self->armed->global == global &&
        self->armed->same_tensors(args)) {
      return true;
    }
    if (!Hit_guards_accept(self, args, nargs, tuple)) return false;
    if (self->armed == nullptr) Hit_arm(self, args, nargs, global);
    return true;
  } catch (...) {
    return false;
  }
}

// ``hit.accepts(*args)``: the checks alone, for tests.
PyObject* Hit_accepts_py(Hit* self, PyObject* args) {
  return PyBool_FromLong(
      Hit_accepts(self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), args));
}

// ``hit.armed``: whether a call's values are recorded (tests).
PyObject* Hit_armed(Hit* self, void*) {
  return PyBool_FromLong(self->armed != nullptr);
}

PyMethodDef Hit_methods[] = {
    {"accepts", (PyCFunction)Hit_accepts_py, METH_VARARGS,
     "Whether the entry's checks accept these positional arguments."},
    {nullptr}};

PyGetSetDef Hit_getset[] = {
    {"armed", (getter)Hit_armed, nullptr, "Whether the guards' values are recorded.", nullptr},
    {nullptr}};

PyTypeObject HitType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---------------------------------------------------------------------------------- Front
struct Front {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* hit;        // the front entry's Hit, or None
  PyObject* fallback;   // the Python __call__: called with the same arguments on anything else
  PyObject* hit_count;  // the state's itertools.count
};

PyTypeObject FrontType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// The front entry's computation on these arguments, its one output, and the hit counted; null
// with the program's error set (raised, never retried: the checks passed).
PyObject* Front_run(Front* self, Hit* h, PyObject* const* args, Py_ssize_t nargs) {
  PyObject* computation = PyDict_GetItemWithError(h->entry_dict, computation_fn_name);
  if (computation == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "an entry without computation_fn");
    return nullptr;
  }
  Py_INCREF(computation);  // borrowed from a dict the program could change
  PyObject* outputs = PyObject_Vectorcall(computation, args, nargs, nullptr);
  Py_DECREF(computation);
  if (outputs == nullptr) return nullptr;
  if (!PyTuple_CheckExact(outputs) || PyTuple_GET_SIZE(outputs) != 1) {
    Py_DECREF(outputs);
    PyErr_SetString(PyExc_SystemError,
                    "keraunos internal error: a computation served by the native hit path "
                    "returned something other than its one output in a tuple");
    return nullptr;
  }
  PyObject* counted = Py_TYPE(self->hit_count)->tp_iternext(self->hit_count);
  Py_XDECREF(counted);
  PyObject* result = PyTuple_GET_ITEM(outputs, 0);
  Py_INCREF(result);
  Py_DECREF(outputs);
  return result;
}

// ``Front.__call__(instance, *args, **kwargs)``, as ``instance.__call__(...)`` calls it.
PyObject* Front_vectorcall(PyObject* callable, PyObject* const* args, size_t nargsf,
                           PyObject* kwnames) {
  Front* self = (Front*)callable;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* hit = self->hit;
  if (hit == Py_None || nargs < 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0)) {
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  Py_INCREF(hit);  // a call may replace the front entry (another thread, a nested call)
  PyObject* result;
  if (Hit_accepts((Hit*)hit, args + 1, nargs - 1)) {
    result = Front_run(self, (Hit*)hit, args + 1, nargs - 1);
  } else {
    result = PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
  }
  Py_DECREF(hit);
  return result;
}

int Front_init(Front* self, PyObject* args, PyObject* kwargs) {
  PyObject *fallback, *hit_count;
  if (!PyArg_ParseTuple(args, "OO", &fallback, &hit_count)) return -1;
  if (Py_TYPE(hit_count)->tp_iternext == nullptr) {
    PyErr_SetString(PyExc_TypeError, "hit_count must be an iterator");
    return -1;
  }
  Py_INCREF(fallback);
  Py_INCREF(hit_count);
  Py_XSETREF(self->fallback, fallback);
  Py_XSETREF(self->hit_count, hit_count);
  Py_INCREF(Py_None);
  Py_XSETREF(self->hit, Py_None);
  self->vectorcall = Front_vectorcall;
  return 0;
}

PyObject* Front_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  Front* self = (Front*)type->tp_alloc(type, 0);
  if (self != nullptr) {
    self->vectorcall = Front_vectorcall;
    Py_INCREF(Py_None);
    self->hit = Py_None;
  }
  return (PyObject*)self;
}

int Front_traverse(Front* self, visitproc visit, void* arg) {
  Py_VISIT(self->hit);
  Py_VISIT(self->fallback);
  Py_VISIT(self->hit_count);
  return 0;
}

int Front_clear(Front* self) {
  Py_CLEAR(self->hit);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->hit_count);
  return 0;
}

void Front_dealloc(Front* self) {
  PyObject_GC_UnTrack(self);
  Front_clear(self);
  Py_TYPE(self)->tp_free((PyObject*)self);
}

// As a class attribute ``__call__`` it is a method: ``instance.__call__`` binds it.
PyObject* Front_descr_get(PyObject* self, PyObject* obj, PyObject* type) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, obj);
}

PyObject* Front_get_hit(Front* self, void*) {
  Py_INCREF(self->hit);
  return self->hit;
}

int Front_set_hit(Front* self, PyObject* value, void*) {
  if (value == nullptr || (value != Py_None && !PyObject_TypeCheck(value, &HitType))) {
    PyErr_SetString(PyExc_TypeError, "hit must be a Hit or None");
    return -1;
  }
  Py_INCREF(value);
  Py_SETREF(self->hit, value);
  return 0;
}

PyGetSetDef Front_getset[] = {
    {"hit", (getter)Front_get_hit, (setter)Front_set_hit,
     "The front entry's Hit, or None: every call then goes to the Python __call__.", nullptr},
    {nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_keraunos_hit_path",
                          "keraunos's native hit path (keraunos/native/hit_path.cpp)", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__keraunos_hit_path(void) {
  computation_fn_name = PyUnicode_InternFromString("computation_fn");
  if (computation_fn_name == nullptr) return nullptr;

  HitType.tp_name = "keraunos.native.Hit";
  HitType.tp_basicsize = sizeof(Hit);
  HitType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  HitType.tp_doc = "Hit(entry, nargs, global_guard, tensor_guards, autocast_dtypes, "
                   "matmul_precision): what one entry's prologue checks, in C.";
  HitType.tp_new = Hit_new;
  HitType.tp_init = (initproc)Hit_init;
  HitType.tp_dealloc = (destructor)Hit_dealloc;
  HitType.tp_traverse = (traverseproc)Hit_traverse;
  HitType.tp_clear = (inquiry)Hit_clear;
  HitType.tp_methods = Hit_methods;
  HitType.tp_getset = Hit_getset;
  if (PyType_Ready(&HitType) < 0) return nullptr;

  FrontType.tp_name = "keraunos.native.Front";
  FrontType.tp_basicsize = sizeof(Front);
  FrontType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                       Py_TPFLAGS_METHOD_DESCRIPTOR;
  FrontType.tp_doc = "Front(fallback, hit_count): a jitted function's __call__.";
  FrontType.tp_vectorcall_offset = offsetof(Front, vectorcall);
  FrontType.tp_call = PyVectorcall_Call;
  FrontType.tp_new = Front_new;
  FrontType.tp_init = (initproc)Front_init;
  FrontType.tp_dealloc = (destructor)Front_dealloc;
  FrontType.tp_traverse = (traverseproc)Front_traverse;
  FrontType.tp_clear = (inquiry)Front_clear;
  FrontType.tp_descr_get = Front_descr_get;
  FrontType.tp_getset = Front_getset;
  if (PyType_Ready(&FrontType) < 0) return nullptr;

  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&HitType);
  Py_INCREF(&FrontType);
  if (PyModule_AddObject(module, "Hit", (PyObject*)&HitType) < 0 ||
      PyModule_AddObject(module, "Front", (PyObject*)&FrontType) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
