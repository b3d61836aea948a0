// The native hit path of keraunos.jit: one C call that checks what the Python hit path of a
// simple entry checks, then runs its computation. keraunos/runtime/native/__init__.py says which entries
// it serves and why it accepts exactly the calls their Python hit path accepts.
//
// Two types:
//   Hit    what one entry's prologue checks: the argument count (no keywords), the ambient
//          settings the prologue compares in Python (autocast dtypes, float32 matmul precision,
//          inference mode), read here from the same C++ getters torch's bindings read, a
//          module's kept walk (its token, its static tensors, the attributes checked by
//          identity), and everything else by recorded values: the first call the checks accept
//          also records the values they depend on (``Armed``), and a later call whose values
//          are all the same is accepted without them. Any other call is decided by the checks
//          themselves: a function's static entry calls dynamo's GlobalStateGuard and
//          TensorGuards objects of its prologue (their own C functions, so they compare exactly
//          what the prologue's calls compare); other entries call the prologue.
//          The computation's inputs are the arguments, the module's static tensors and size
//          symbols read from the arguments (``Source``).
//   Front  a jitted function's or module's ``__call__``: a method descriptor (so ``jitted(x)``
//          reaches it with no Python frame) that runs the front entry's Hit, and otherwise calls
//          the Python ``__call__`` it was given, which explains misses and compiles.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/macros/Export.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <tuple>
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
  std::vector<TensorMeta> tensors;  // the arguments', then the statics'
  size_t nargs;

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

  // The arguments', then the statics' (the module's parameters and buffers, in order).
  bool same_tensors(PyObject* const* args, PyObject* statics) const {
    size_t nstatics = statics ? (size_t)PyTuple_GET_SIZE(statics) : 0;
    if (tensors.size() != nargs + nstatics) return false;
    for (size_t i = 0; i < tensors.size(); i++) {
      const TensorMeta& meta = tensors[i];
      PyObject* item = i < nargs ? args[i] : PyTuple_GET_ITEM(statics, i - nargs);
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
// Where each of the computation's inputs comes from: an argument, the module's static tensors
// (the fast prologue's kept walk, ``_s[1]``, spliced in), or a size or stride of an argument
// (a size symbol the prologue binds: ``s0 = x.shape[0]``).
struct Source {
  enum Kind { ARG, STATICS, SIZE, STRIDE } kind;
  Py_ssize_t index;  // the argument (ARG, SIZE, STRIDE)
  int64_t dim;       // the dimension (SIZE, STRIDE)
};

struct Hit {
  PyObject_HEAD
  PyObject* entry;          // the CacheEntry
  PyObject* entry_dict;     // its __dict__: computation_fn read from it on every call (tiers)
  Py_ssize_t nargs;
  PyObject* global_guard;   // GlobalStateGuard, or null: the prologue decides (below)
  PyCFunction global_check;
  PyObject* tensor_guards;  // TensorGuards, or null
  PyCFunctionWithKeywords tensor_check;
  PyObject* prologue;       // the entry's prologue: decides a call the record does not, where
                            // there are no guards to call
  PyObject* structure;      // the fast prologue's kept module walk (a list), or null: a function
  PyObject* tree_token;     // runtime/structure.py's _tree_token (a list), or null
  std::vector<Source>* sources;  // the computation's inputs; null: the arguments as they came
  std::vector<std::pair<c10::DeviceType, c10::ScalarType>>* autocast_dtypes;
  int matmul_precision;     // at::Float32MatmulPrecision as an int; -1: not checked
  int inference_mode;       // whether inference mode must be on (1) or off (0); -1: not checked
  // Module attributes the prologue checks by identity in the walk's ``__dict__``s (``_s[2]``),
  // on every call: (dict index, key, expected object), borrowed from ``attributes``.
  PyObject* attributes;
  std::vector<std::tuple<Py_ssize_t, PyObject*, PyObject*>>* attribute_checks;
  Armed* armed;             // null until a call whose values can be armed is accepted
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

bool parse_sources(PyObject* spec, std::vector<Source>& out) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(spec); i++) {
    int kind;
    Py_ssize_t index;
    long long dim;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(spec, i), "inL", &kind, &index, &dim)) return false;
    if (kind < Source::ARG || kind > Source::STRIDE) {
      PyErr_SetString(PyExc_ValueError, "unknown input source");
      return false;
    }
    out.push_back({(Source::Kind)kind, index, (int64_t)dim});
  }
  return true;
}

int Hit_init(Hit* self, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"entry", "nargs", "global_guard", "tensor_guards",
                                   "autocast_dtypes", "matmul_precision", "prologue",
                                   "structure", "tree_token", "sources", "inference_mode",
                                   "attributes", nullptr};
  PyObject *entry, *global_guard, *tensor_guards, *autocast;
  PyObject *prologue = Py_None, *structure = Py_None, *tree_token = Py_None, *spec = Py_None;
  PyObject* attributes = nullptr;
  Py_ssize_t nargs;
  int matmul_precision, inference_mode = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnOOO!i|OOOOiO!", (char**)keywords, &entry,
                                   &nargs, &global_guard, &tensor_guards, &PyTuple_Type,
                                   &autocast, &matmul_precision, &prologue, &structure,
                                   &tree_token, &spec, &inference_mode, &PyTuple_Type,
                                   &attributes)) {
    return -1;
  }
  auto checks = new std::vector<std::tuple<Py_ssize_t, PyObject*, PyObject*>>();
  for (Py_ssize_t i = 0; attributes != nullptr && i < PyTuple_GET_SIZE(attributes); i++) {
    Py_ssize_t index;
    PyObject *key, *expected;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(attributes, i), "nO!O", &index, &PyUnicode_Type,
                          &key, &expected)) {
      delete checks;
      return -1;
    }
    checks->emplace_back(index, key, expected);
  }
  // Held from here on (freed with the Hit), with the tuple their pointers borrow from.
  Py_XINCREF(attributes);
  Py_XSETREF(self->attributes, attributes);
  delete self->attribute_checks;
  self->attribute_checks = checks;
  self->inference_mode = inference_mode;
  if (!checks->empty() && structure == Py_None) {
    PyErr_SetString(PyExc_TypeError, "Hit: attribute checks need the module walk");
    return -1;
  }
  if ((global_guard == Py_None) != (tensor_guards == Py_None) ||
      (global_guard == Py_None && prologue == Py_None) ||
      (structure == Py_None) != (tree_token == Py_None) ||
      (structure != Py_None && (!PyList_CheckExact(structure) ||
                                !PyList_CheckExact(tree_token))) ||
      (spec != Py_None && !PyTuple_Check(spec))) {
    PyErr_SetString(PyExc_TypeError, "Hit: guards both or neither (then a prologue), structure "
                    "and tree_token both lists or neither, sources a tuple or None");
    return -1;
  }
  PyCFunction global_check = nullptr;
  PyCFunctionWithKeywords tensor_check = nullptr;
  if (global_guard != Py_None) {
    global_check = (PyCFunction)c_method(global_guard, "check", METH_NOARGS);
    if (global_check == nullptr) return -1;
    tensor_check = (PyCFunctionWithKeywords)c_method(tensor_guards, "check",
                                                     METH_VARARGS | METH_KEYWORDS);
    if (tensor_check == nullptr) return -1;
  }
  auto sources = spec == Py_None ? nullptr : new std::vector<Source>();
  if (sources != nullptr && !parse_sources(spec, *sources)) {
    delete sources;
    return -1;
  }
  auto dtypes = new std::vector<std::pair<c10::DeviceType, c10::ScalarType>>();
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(autocast); i++) {
    PyObject* item = PyTuple_GET_ITEM(autocast, i);
    const char* device;
    PyObject* dtype;
    if (!PyArg_ParseTuple(item, "sO", &device, &dtype) || !THPDtype_Check(dtype)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "expected (device type, dtype)");
      delete dtypes;
      delete sources;
      return -1;
    }
    try {
      dtypes->emplace_back(c10::Device(device).type(), ((THPDtype*)dtype)->scalar_type);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
      delete dtypes;
      delete sources;
      return -1;
    }
  }
  // The instance dict itself (made now where attributes are kept inline), read on every call:
  // a tier switch sets the entry's computation_fn there (CacheEntry has no slot or descriptor
  // for it).
  PyObject* entry_dict = PyObject_GenericGetDict(entry, nullptr);
  if (entry_dict == nullptr) {
    delete dtypes;
    delete sources;
    return -1;
  }
  auto keep = [](PyObject* o) -> PyObject* {
    if (o == Py_None) return nullptr;
    Py_INCREF(o);
    return o;
  };
  Py_XSETREF(self->entry_dict, entry_dict);
  Py_INCREF(entry);
  Py_XSETREF(self->entry, entry);
  Py_XSETREF(self->global_guard, keep(global_guard));
  Py_XSETREF(self->tensor_guards, keep(tensor_guards));
  Py_XSETREF(self->prologue, keep(prologue));
  Py_XSETREF(self->structure, keep(structure));
  Py_XSETREF(self->tree_token, keep(tree_token));
  delete self->autocast_dtypes;
  self->autocast_dtypes = dtypes;
  delete self->sources;
  self->sources = sources;
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
  Py_VISIT(self->prologue);
  Py_VISIT(self->structure);
  Py_VISIT(self->tree_token);
  Py_VISIT(self->attributes);
  return 0;
}

int Hit_clear(Hit* self) {
  Py_CLEAR(self->entry);
  Py_CLEAR(self->entry_dict);
  Py_CLEAR(self->global_guard);
  Py_CLEAR(self->tensor_guards);
  Py_CLEAR(self->prologue);
  Py_CLEAR(self->structure);
  Py_CLEAR(self->tree_token);
  Py_CLEAR(self->attributes);
  return 0;
}

void Hit_dealloc(Hit* self) {
  PyObject_GC_UnTrack(self);
  Hit_clear(self);
  delete self->autocast_dtypes;
  delete self->sources;
  delete self->attribute_checks;
  delete self->armed;
  Py_TYPE(self)->tp_free((PyObject*)self);
}

PyObject* Hit_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  Hit* self = (Hit*)type->tp_alloc(type, 0);
  if (self != nullptr) {
    self->autocast_dtypes = nullptr;
    self->sources = nullptr;
    self->attribute_checks = nullptr;
    self->inference_mode = -1;
    self->matmul_precision = -1;
    self->armed = nullptr;
  }
  return (PyObject*)self;
}

// The settings the prologue compares in Python, read from the getters behind its calls.
bool Hit_python_settings_match(Hit* self) {
  if (self->inference_mode >= 0 && (int)c10::InferenceMode::is_enabled() != self->inference_mode) {
    return false;
  }
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

// The computation's inputs for one call: borrowed (the arguments as they came, or the tuple
// the prologue returned) or built from ``sources`` (new references, released with it).
struct Inputs {
  PyObject* const* items = nullptr;
  Py_ssize_t n = 0;
  PyObject* tuple = nullptr;  // the prologue's inputs, held
  // Built inputs: in ``inline_items`` when they fit (no allocation on the hit), else ``heap``.
  static constexpr Py_ssize_t INLINE = 16;
  PyObject* inline_items[INLINE];
  std::vector<PyObject*> heap;
  Py_ssize_t built = 0;  // new references held in the first ``built`` of them
  Inputs() = default;
  Inputs(const Inputs&) = delete;
  ~Inputs() {
    PyObject** own = heap.empty() ? inline_items : heap.data();
    for (Py_ssize_t i = 0; i < built; i++) Py_DECREF(own[i]);
    Py_XDECREF(tuple);
  }

  // From the sources; false (nothing set) where one cannot be read.
  bool build(const std::vector<Source>& sources, PyObject* const* args, PyObject* statics) {
    Py_ssize_t nstatics = statics ? PyTuple_GET_SIZE(statics) : 0;
    Py_ssize_t total = 0;
    for (const Source& s : sources) total += s.kind == Source::STATICS ? nstatics : 1;
    PyObject** own = inline_items;
    if (total > INLINE) {
      heap.resize(total);
      own = heap.data();
    }
    for (const Source& s : sources) {
      if (s.kind == Source::ARG) {
        Py_INCREF(args[s.index]);
        own[built++] = args[s.index];
      } else if (s.kind == Source::STATICS) {
        if (statics == nullptr) return false;
        for (Py_ssize_t i = 0; i < nstatics; i++) {
          Py_INCREF(PyTuple_GET_ITEM(statics, i));
          own[built++] = PyTuple_GET_ITEM(statics, i);
        }
      } else {
        const auto* impl = THPVariable_Unpack(args[s.index]).unsafeGetTensorImpl();
        auto values = s.kind == Source::SIZE ? impl->sizes() : impl->strides();
        if (s.dim < 0 || s.dim >= (int64_t)values.size()) return false;
        PyObject* value = PyLong_FromLongLong(values[s.dim]);
        if (value == nullptr) {
          PyErr_Clear();
          return false;
        }
        own[built++] = value;
      }
    }
    items = own;
    n = built;
    return true;
  }

  // Whether ``other`` holds the same inputs: the same objects, ints equal.
  bool same_as(PyObject* other) const {
    if (!PyTuple_Check(other) || PyTuple_GET_SIZE(other) != n) return false;
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *a = items[i], *b = PyTuple_GET_ITEM(other, i);
      if (a == b) continue;
      if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b)) return false;
      int equal = PyObject_RichCompareBool(a, b, Py_EQ);
      if (equal != 1) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
};

// The module's static tensors as the prologue would take them (``_s[1]`` of ``_structure[0]``,
// borrowed), or null where its walk must run again first (the tree changed): the prologue
// decides then.
bool Hit_statics(Hit* self, PyObject** statics) {
  *statics = nullptr;
  if (self->structure == nullptr) return true;
  if (PyList_GET_SIZE(self->structure) < 1 || PyList_GET_SIZE(self->tree_token) < 1) {
    return false;
  }
  PyObject* walk = PyList_GET_ITEM(self->structure, 0);
  if (!PyTuple_CheckExact(walk) || PyTuple_GET_SIZE(walk) < 2 ||
      PyTuple_GET_ITEM(walk, 0) != PyList_GET_ITEM(self->tree_token, 0) ||
      !PyTuple_CheckExact(PyTuple_GET_ITEM(walk, 1))) {
    return false;
  }
  *statics = PyTuple_GET_ITEM(walk, 1);
  if (self->attribute_checks == nullptr || self->attribute_checks->empty()) return true;
  // The attributes, as the prologue's ``_attribute_dicts[i][key] is not expected`` reads them.
  PyObject* dicts = PyTuple_GET_SIZE(walk) > 2 ? PyTuple_GET_ITEM(walk, 2) : nullptr;
  if (dicts == nullptr || !PyTuple_CheckExact(dicts)) return false;
  for (const auto& [index, key, expected] : *self->attribute_checks) {
    if (index >= PyTuple_GET_SIZE(dicts) || !PyDict_CheckExact(PyTuple_GET_ITEM(dicts, index))) {
      return false;
    }
    PyObject* value = PyDict_GetItemWithError(PyTuple_GET_ITEM(dicts, index), key);
    if (value != expected) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// Records this call's values, when they can be armed and (where the prologue decided) the
// sources give exactly the inputs it returned.
void Hit_arm(Hit* self, PyObject* const* args, Py_ssize_t nargs, PyObject* statics,
             const GlobalValues& global, PyObject* prologue_inputs) {
  if (!Armed::armable(global)) return;
  Py_ssize_t nstatics = statics ? PyTuple_GET_SIZE(statics) : 0;
  // The old record's vectors are reused where they fit (a symbolic entry called with other
  // sizes records each accepted call: no allocation per tensor); detached while filled.
  Armed* armed = self->armed;
  self->armed = nullptr;
  if (armed != nullptr && armed->tensors.size() == (size_t)(nargs + nstatics)) {
    armed->global = global;
    armed->nargs = (size_t)nargs;
  } else {
    delete armed;
    armed = new Armed{global, std::vector<TensorMeta>(nargs + nstatics), (size_t)nargs};
  }
  for (Py_ssize_t i = 0; i < nargs + nstatics; i++) {
    PyObject* item = i < nargs ? args[i] : PyTuple_GET_ITEM(statics, i - nargs);
    if (!Armed::read(item, armed->tensors[i])) {
      delete armed;
      return;
    }
  }
  if (prologue_inputs != nullptr) {
    Inputs inputs;
    bool same = self->sources != nullptr ? inputs.build(*self->sources, args, statics)
                                         : (inputs.items = args, inputs.n = nargs, true);
    if (!same || !inputs.same_as(prologue_inputs)) {
      delete armed;
      return;
    }
  }
  self->armed = armed;
}

// Whether the entry's checks accept these positional arguments, and the computation's inputs
// when they do. Nothing raises here: where anything fails, the Python hit path decides (and
// explains).
bool Hit_accepts(Hit* self, PyObject* const* args, Py_ssize_t nargs, Inputs& inputs,
                 PyObject* tuple = nullptr) {
  if (nargs != self->nargs || !Hit_python_settings_match(self)) return false;
  try {
    PyObject* statics;
    if (!Hit_statics(self, &statics)) return false;
    GlobalValues global = GlobalValues::now();
    if (self->armed != nullptr && self->armed->global == global &&
        self->armed->same_tensors(args, statics)) {
      if (self->sources == nullptr) {
        inputs.items = args;
        inputs.n = nargs;
        return true;
      }
      return inputs.build(*self->sources, args, statics);
    }
    if (self->global_guard != nullptr) {  // a function's static entry: its guards, in C
      if (!Hit_guards_accept(self, args, nargs, tuple)) return false;
      if (self->armed == nullptr) Hit_arm(self, args, nargs, nullptr, global, nullptr);
      inputs.items = args;
      inputs.n = nargs;
      return true;
    }
    // The prologue itself: ``(inputs, pro_to_epi)`` when it accepts.
    PyObject* r = PyObject_Vectorcall(self->prologue, args, nargs, nullptr);
    if (r == nullptr || !PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 2 ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(r, 0))) {
      Py_XDECREF(r);
      PyErr_Clear();
      return false;
    }
    PyObject* accepted = PyTuple_GET_ITEM(r, 0);
    Py_INCREF(accepted);
    Py_DECREF(r);
    inputs.tuple = accepted;
    inputs.items = &PyTuple_GET_ITEM(accepted, 0);
    inputs.n = PyTuple_GET_SIZE(accepted);
    // The walk may have run again inside: the statics are read anew for the record.
    if (Hit_statics(self, &statics)) Hit_arm(self, args, nargs, statics, global, accepted);
    return true;
  } catch (...) {
    return false;
  }
}

// ``hit.accepts(*args)``: the checks alone, for tests.
PyObject* Hit_accepts_py(Hit* self, PyObject* args) {
  Inputs inputs;
  return PyBool_FromLong(
      Hit_accepts(self, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args), inputs, args));
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
PyObject* Front_run(Front* self, Hit* h, const Inputs& inputs) {
  PyObject* computation = PyDict_GetItemWithError(h->entry_dict, computation_fn_name);
  if (computation == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "an entry without computation_fn");
    return nullptr;
  }
  Py_INCREF(computation);  // borrowed from a dict the program could change
  PyObject* outputs = PyObject_Vectorcall(computation, inputs.items, inputs.n, nullptr);
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
  Inputs inputs;
  if (Hit_accepts((Hit*)hit, args + 1, nargs - 1, inputs)) {
    result = Front_run(self, (Hit*)hit, inputs);
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

// ``front.__wrapped__``: the Python ``__call__`` it falls back to, whose signature
// ``inspect.signature`` then reports (a jitted module's is its original ``forward``'s).
PyObject* Front_get_wrapped(Front* self, void*) {
  Py_INCREF(self->fallback);
  return self->fallback;
}

PyGetSetDef Front_getset[] = {
    {"hit", (getter)Front_get_hit, (setter)Front_set_hit,
     "The front entry's Hit, or None: every call then goes to the Python __call__.", nullptr},
    {"__wrapped__", (getter)Front_get_wrapped, nullptr,
     "The Python __call__ it falls back to.", nullptr},
    {nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_keraunos_hit_path",
                          "keraunos's native hit path (keraunos/runtime/native/hit_path.cpp)", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__keraunos_hit_path(void) {
  computation_fn_name = PyUnicode_InternFromString("computation_fn");
  if (computation_fn_name == nullptr) return nullptr;

  HitType.tp_name = "keraunos.runtime.native.Hit";
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

  FrontType.tp_name = "keraunos.runtime.native.Front";
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
