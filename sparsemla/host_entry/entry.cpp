// The compiled host entry of sparse_mla_decode / sparse_mla_prefill (over a PagedKVCache), SparseMLA.run and the
// vLLM plugin's LayerAttention.forward: a call whose configuration the Python path has launched before is replayed
// here, without Python.
//
// A configuration is what decides everything a call launches apart from its tensors' addresses and its scales:
// the mode, the format object, the backend argument, q's shape and strides, the indices' width and row stride,
// whether valid_counts is given, the given out / lse strides, the device and the current stream; for SparseMLA.run the runner, its planned
// step, q's shape and strides, topk_local's width and strides, the given out / lse strides, the cache's format and
// geometry, the device and the stream; for a vLLM layer the workspace, the layers' shared settings, q's (or the
// pair's) shape and strides, the indices' width and row stride, the cache tensor's geometry, the device and the
// stream.  The first call of a configuration takes the Python path (every argument
// checked, the backend chosen, the plan made, the kernels compiled and launched); where that call made only direct
// launches (sparsemla.kernels.launch), the launch sites record them here as templates: each launch's C function
// (Triton's) and its arguments, with the per-call values (addresses, the scales) marked by slot.  A later call with
// the same configuration checks what the host knows (types, dtypes, shapes, strides, devices, 16-byte alignment),
// allocates the outputs it was not given, fills the slots and calls the same C functions with the same arguments
// the Python path would pass.
//
// Anything this entry does not handle returns None (not eligible: the Python path serves the call, and raises
// where the arguments are wrong) or a bytes key (eligible, not recorded yet: the Python path serves the call and
// records it under that key).  Every object is used with the GIL held.
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <exception>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Per-call values a template slot takes (sparsemla/host_entry/__init__.py: SLOTS, the same order).
enum Slot : int { CONST = 0, Q, QR, ROWS, IDX, VC, OUT, LSE, SCALE, KSCALE, TOPK, NUM_SLOTS };

constexpr double LOG2E = 1.4426950408889634;
constexpr int KEY_WORDS = 32;
constexpr size_t MAX_ENTRIES = 4096;
constexpr Py_ssize_t MAX_ARGS = 96;

struct Key {
  int64_t w[KEY_WORDS] = {0};  // (words a key does not use stay 0)
  bool operator==(const Key& o) const { return std::memcmp(w, o.w, sizeof(w)) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : k.w) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// One argument list: constants (owned references) and the slots filled per call, a slot's value plus an offset
// (a runner's prefill tokens read q and the outputs some rows in; 0 elsewhere).
struct Args {
  std::vector<PyObject*> value;  // nullptr where kind != CONST
  std::vector<int> kind;
  std::vector<int64_t> offset;
};

struct LaunchRec {
  PyObject* fn = nullptr;  // the launch's C function (owned)
  Args outer;              // its positional arguments
  bool packed = false;     // the last positional argument is a tuple made of `inner` (Triton >= 3.8)
  Args inner;
};

struct Entry {
  std::vector<LaunchRec> launches;
  int64_t qr_offset = 0;  // bytes from q's address to its RoPE part (0 for NoPE rows)
  PyObject* keep = nullptr;  // what the constants point into (the format, the split-partials buffer): owned
  PyObject* out = nullptr;   // a runner's own out / lse (the outputs of a call that passes none): owned
  PyObject* lse = nullptr;
  int64_t max_block = -1;    // a runner's largest planned block id: a cache must hold more blocks
};

// (shared: a replay holds its entry while it calls into Triton, whatever clears the map meanwhile.  Never destroyed:
// at the process's exit a destructor would release Python references without the GIL.)
using Map = std::unordered_map<Key, std::shared_ptr<Entry>, KeyHash>;
Map& g_entries = *new Map();

// Set by configure(): what the call reads of the process's state (torch's and Triton's functions; stand-ins in tests).
PyObject* g_cache_type = nullptr;   // sparsemla.cache.PagedKVCache
PyObject* g_get_device = nullptr;   // () -> the current CUDA device's index
PyObject* g_get_stream = nullptr;   // (index) -> the current stream's handle on that device
PyObject* g_capturing = nullptr;    // () -> whether the current stream is capturing a CUDA graph
PyObject* g_runtime = nullptr;      // triton.knobs.runtime (its launch hooks)
PyObject* g_local = nullptr;        // the launcher's thread-local state (per_call: partials per call, custom ops)
PyObject* g_str_enter = nullptr;    // attribute names, interned
PyObject* g_str_exit = nullptr;
PyObject* g_str_calls = nullptr;
PyObject* g_str_per_call = nullptr;
PyObject* g_str_rows = nullptr;
PyObject* g_str_fmt = nullptr;
PyObject* g_str_planned = nullptr;
PyObject* g_str_block_size = nullptr;
PyObject* g_str_block_stride = nullptr;
PyObject* g_str_num_blocks = nullptr;
double g_scale_min = 0.0, g_scale_max = 0.0;
bool g_allow_cpu = false;           // tests: CPU tensors (device index -1) with a test context

void release(Args& a) {
  for (PyObject* o : a.value) Py_XDECREF(o);
  a.value.clear();
  a.kind.clear();
  a.offset.clear();
}

void release(Entry& e) {
  for (LaunchRec& l : e.launches) {
    Py_XDECREF(l.fn);
    l.fn = nullptr;
    release(l.outer);
    release(l.inner);
  }
  Py_XDECREF(e.keep);
  Py_XDECREF(e.out);
  Py_XDECREF(e.lse);
  e.keep = e.out = e.lse = nullptr;
}

struct Release {  // an entry's references go when its last holder does
  void operator()(Entry* e) const {
    release(*e);
    delete e;
  }
};

void clear_entries() {
  // Move the map out first: a destructor run by a decref must not see a half-cleared map.
  Map old;
  old.swap(g_entries);
}

// -1: error; 1: the attribute is an installed hook (a HookChain with calls, or a plain callable); 0: none.
int hooked(PyObject* name) {
  PyObject* h = PyObject_GetAttr(g_runtime, name);
  if (h == nullptr) return -1;
  int r = 0;
  if (h != Py_None) {
    PyObject* calls = PyObject_GetAttr(h, g_str_calls);  // Triton >= 3.5: a HookChain, empty when none installed
    if (calls == nullptr) {
      PyErr_Clear();
      r = 1;
    } else {
      r = PyObject_IsTrue(calls);
      Py_DECREF(calls);
    }
  }
  Py_DECREF(h);
  return r;
}

// 1: a replay may run now on device `want` (*stream set); 0: the Python path must serve the call (a CUDA graph being
// captured, partials per call, a profiler's launch hook: every launch then goes through Triton; q not on the
// current device: the Python path raises); -1: error.
int context(long long want, long long* stream) {
  PyObject* cap = PyObject_CallNoArgs(g_capturing);
  if (cap == nullptr) return -1;
  int busy = PyObject_IsTrue(cap);
  Py_DECREF(cap);
  if (busy != 0) return busy < 0 ? -1 : 0;
  PyObject* pc = PyObject_GetAttr(g_local, g_str_per_call);
  if (pc == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
  } else {
    busy = PyObject_IsTrue(pc);
    Py_DECREF(pc);
    if (busy != 0) return busy < 0 ? -1 : 0;
  }
  for (PyObject* name : {g_str_enter, g_str_exit}) {
    busy = hooked(name);
    if (busy != 0) return busy < 0 ? -1 : 0;
  }
  PyObject* d = PyObject_CallNoArgs(g_get_device);
  if (d == nullptr) return -1;
  const long long cdev = PyLong_AsLongLong(d);
  if (cdev != want) {  // (before the stream: nothing is asked of a device the call will not run on)
    Py_DECREF(d);
    return PyErr_Occurred() ? -1 : 0;
  }
  PyObject* s = PyObject_CallOneArg(g_get_stream, d);
  Py_DECREF(d);
  if (s == nullptr) return -1;
  *stream = PyLong_AsLongLong(s);
  Py_DECREF(s);
  return PyErr_Occurred() ? -1 : 1;
}

inline bool exact_float(PyObject* o, double* v) {
  if (!PyFloat_CheckExact(o)) return false;
  *v = PyFloat_AS_DOUBLE(o);
  return true;
}

inline uint64_t address(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// A plain dense torch.Tensor (not a subclass: FakeTensor and other wrappers go through Python; not sparse, not
// nested: they have no strides), or nullptr.
inline const at::Tensor* plain(PyObject* o) {
  if (!THPVariable_CheckExact(o)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  return t.defined() && t.layout() == at::kStrided && !t.is_nested() ? &t : nullptr;
}

// The per-call values of one call: each pointer slot's address, the slots as Python objects, and the objects made
// for values at an offset (released with the rest).
struct Values {
  uint64_t raw[NUM_SLOTS] = {0};
  PyObject* slot[NUM_SLOTS] = {nullptr};
  std::vector<PyObject*> made;
  ~Values() {
    for (PyObject* o : slot) Py_XDECREF(o);
    for (PyObject* o : made) Py_XDECREF(o);
  }
};

// Argument i of `a` (a borrowed reference, nullptr on failure).
PyObject* value(const Args& a, size_t i, Values& v) {
  const int k = a.kind[i];
  if (k == CONST) return a.value[i];
  if (a.offset[i] == 0) return v.slot[k];
  PyObject* o = PyLong_FromUnsignedLongLong(v.raw[k] + static_cast<uint64_t>(a.offset[i]));
  if (o != nullptr) v.made.push_back(o);
  return o;
}

bool fill(const Args& a, Values& v, PyObject** dst) {
  const size_t n = a.kind.size();
  for (size_t i = 0; i < n; ++i) {
    PyObject* x = value(a, i, v);
    if (x == nullptr) return false;
    dst[i] = x;
  }
  return true;
}

// q: a plain bf16 [t >= 1, h, d] tensor with a contiguous last dim, on a CUDA device (or the CPU in tests).
bool query(PyObject* qo, const at::Tensor** q, int64_t* t, int64_t* h, int64_t* d) {
  const at::Tensor* x = plain(qo);
  if (x == nullptr || x->dim() != 3 || x->scalar_type() != at::kBFloat16 || x->stride(2) != 1 || x->size(0) < 1)
    return false;
  const at::Device dev = x->device();
  if (!(dev.is_cuda() || (g_allow_cpu && dev.is_cpu()))) return false;
  *q = x;
  *t = x->size(0), *h = x->size(1), *d = x->size(2);
  return true;
}

// A scale: an exact Python float within the range the Python path accepts (its value in *v where v is given).
bool scale(PyObject* o, double* v) {
  double x;
  if (!exact_float(o, &x) || !(x >= g_scale_min && x <= g_scale_max)) return false;
  if (v != nullptr) *v = x;
  return true;
}

// The indices, int32 [t, K] with contiguous rows, and the optional valid counts, contiguous int32 [t], on `dev`.
bool index_parts(PyObject* io, PyObject* vco, int64_t t, const at::Device& dev, const at::Tensor** idx,
                 const at::Tensor** vc) {
  const at::Tensor* i = plain(io);
  if (i == nullptr || i->dim() != 2 || i->scalar_type() != at::kInt || i->size(0) != t || i->stride(1) != 1 ||
      i->device() != dev)
    return false;
  *idx = i;
  *vc = nullptr;
  if (vco != Py_None) {
    const at::Tensor* c = plain(vco);
    if (c == nullptr || c->dim() != 1 || c->scalar_type() != at::kInt || c->size(0) != t || c->stride(0) != 1 ||
        c->device() != dev)
      return false;
    *vc = c;
  }
  return true;
}

// The optional outputs: absent, or bf16 [t, h, 512] (last dim contiguous) and fp32 [t, h] on `dev`.
bool outputs(PyObject* outo, PyObject* lseo, int64_t t, int64_t h, const at::Device& dev, const at::Tensor** out,
             const at::Tensor** lse) {
  *out = *lse = nullptr;
  if (outo != Py_None) {
    const at::Tensor* o = plain(outo);
    if (o == nullptr || o->dim() != 3 || o->scalar_type() != at::kBFloat16 || o->size(0) != t || o->size(1) != h ||
        o->size(2) != 512 || o->stride(2) != 1 || o->device() != dev)
      return false;
    *out = o;
  }
  if (lseo != Py_None) {
    const at::Tensor* l = plain(lseo);
    if (l == nullptr || l->dim() != 2 || l->scalar_type() != at::kFloat || l->size(0) != t || l->size(1) != h ||
        l->device() != dev)
      return false;
    *lse = l;
  }
  return true;
}

// A PagedKVCache's rows (their address; a tensor on `dev`) and format (its identity: the cache keeps it alive).
bool cache_parts(PyObject* cache, const at::Device& dev, uint64_t* pr, PyObject** fmt) {
  const int r = PyObject_IsInstance(cache, g_cache_type);
  if (r <= 0) {
    if (r < 0) PyErr_Clear();
    return false;
  }
  PyObject* rows_o = PyObject_GetAttr(cache, g_str_rows);
  if (rows_o == nullptr) {
    PyErr_Clear();
    return false;
  }
  const at::Tensor* rows = plain(rows_o);
  const bool ok = rows != nullptr && rows->device() == dev;
  if (ok) *pr = address(*rows);
  Py_DECREF(rows_o);
  PyObject* f = ok ? PyObject_GetAttr(cache, g_str_fmt) : nullptr;
  if (f == nullptr) {
    PyErr_Clear();
    return false;
  }
  Py_DECREF(f);
  *fmt = f;
  return true;
}

// 1: a replay may run on q's device (*stream set); 0: the Python path serves the call; -1: error.
int ready_on(const at::Device& dev, long long* stream) {
  return context(dev.is_cuda() ? dev.index() : -1, stream);
}

// The launches of `e` with the per-call values `v` (its pointer slots' addresses set by the caller, q's, its RoPE
// part's, the rows', the outputs' and k_scale's here).  Returns (out, lse), or raises what a launch raised.
PyObject* replay(const Entry& e, Values& v, uint64_t pq, uint64_t pqr, uint64_t pr, PyObject* ks, at::Tensor out_t,
                 at::Tensor lse_t) {
  v.raw[Q] = pq;
  v.raw[QR] = pqr;
  v.raw[ROWS] = pr;
  v.raw[OUT] = address(out_t);
  v.raw[LSE] = address(lse_t);
  for (int k : {Q, QR, ROWS, IDX, VC, OUT, LSE, TOPK}) v.slot[k] = PyLong_FromUnsignedLongLong(v.raw[k]);
  v.slot[KSCALE] = ks;
  Py_INCREF(ks);
  bool ok = !PyErr_Occurred();  // (from here on a failure is the launch's: raised, as the Python path would)
  for (const LaunchRec& l : e.launches) {
    if (!ok) break;
    PyObject* argv[MAX_ARGS];
    const size_t n_outer = l.outer.kind.size();
    if (n_outer + 1 > static_cast<size_t>(MAX_ARGS) || !fill(l.outer, v, argv)) { ok = false; break; }
    PyObject* packed = nullptr;
    if (l.packed) {
      const size_t n_inner = l.inner.kind.size();
      packed = PyTuple_New(static_cast<Py_ssize_t>(n_inner));
      if (packed == nullptr) { ok = false; break; }
      for (size_t j = 0; ok && j < n_inner; ++j) {
        PyObject* x = value(l.inner, j, v);
        if (x == nullptr) { ok = false; break; }
        Py_INCREF(x);
        PyTuple_SET_ITEM(packed, static_cast<Py_ssize_t>(j), x);
      }
      if (!ok) { Py_DECREF(packed); break; }
      argv[n_outer] = packed;
    }
    PyObject* rv = PyObject_Vectorcall(l.fn, argv, n_outer + (l.packed ? 1 : 0), nullptr);
    Py_XDECREF(packed);
    if (rv == nullptr) { ok = false; break; }
    Py_DECREF(rv);
  }
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "sparsemla host entry: a replayed launch failed");
    return nullptr;
  }
  PyObject* po = THPVariable_Wrap(std::move(out_t));
  PyObject* pl = THPVariable_Wrap(std::move(lse_t));
  PyObject* result = po && pl ? PyTuple_Pack(2, po, pl) : nullptr;
  Py_XDECREF(po);
  Py_XDECREF(pl);
  return result;
}

PyObject* call_impl(PyObject* const* a, Py_ssize_t n) {
  if (n != 11 || g_cache_type == nullptr) Py_RETURN_NONE;
  PyObject *mode = a[0], *qo = a[1], *cache = a[2], *io = a[3], *sm = a[4], *vco = a[5], *ks = a[6],
           *backend = a[7], *outo = a[8], *lseo = a[9], *check = a[10];
  if (check != Py_False) Py_RETURN_NONE;
  double sm_scale;
  if (!scale(sm, &sm_scale) || !scale(ks, nullptr)) Py_RETURN_NONE;
  const at::Tensor* q;
  int64_t t, h, d;
  if (!query(qo, &q, &t, &h, &d)) Py_RETURN_NONE;
  const at::Device dev = q->device();
  const at::Tensor *idx, *vc;
  if (!index_parts(io, vco, t, dev, &idx, &vc)) Py_RETURN_NONE;
  const at::Tensor *out, *lse;
  uint64_t pr = 0;
  PyObject* fmt = nullptr;
  if (!outputs(outo, lseo, t, h, dev, &out, &lse) || !cache_parts(cache, dev, &pr, &fmt)) Py_RETURN_NONE;
  // Device, stream, and whether the Python path must serve the call (a launch hook, a CUDA-graph capture, ...).
  long long stream = 0;
  const int ready = ready_on(dev, &stream);
  if (ready < 0) return nullptr;
  if (ready == 0) Py_RETURN_NONE;
  const long long qdev = dev.is_cuda() ? dev.index() : -1;

  const uint64_t pq = address(*q), pi = address(*idx), pv = vc ? address(*vc) : pi;
  uint64_t align = pq | pr | pi | pv;
  if (out) align |= address(*out);
  if (lse) align |= address(*lse);
  if (align & 15) Py_RETURN_NONE;  // the Python path launches unaligned tensors through Triton

  Key key;
  int64_t* w = key.w;
  w[0] = PyLong_AsLong(mode);
  w[1] = reinterpret_cast<int64_t>(fmt);
  w[2] = t; w[3] = h; w[4] = d;
  w[5] = q->stride(0); w[6] = q->stride(1);
  w[7] = idx->size(1); w[8] = idx->stride(0);
  w[9] = vc != nullptr;
  w[10] = out != nullptr; w[11] = out ? out->stride(0) : 0; w[12] = out ? out->stride(1) : 0;
  w[13] = lse != nullptr; w[14] = lse ? lse->stride(0) : 0; w[15] = lse ? lse->stride(1) : 0;
  w[16] = qdev; w[17] = stream;
  w[18] = reinterpret_cast<int64_t>(backend);  // "auto", a name or a Backend, by identity (the record keeps it)
  if (PyErr_Occurred()) return nullptr;
  auto it = g_entries.find(key);
  if (it == g_entries.end()) return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(key.w));
  const std::shared_ptr<Entry> held = it->second;
  const Entry& e = *held;

  at::Tensor out_t = out ? *out : at::empty({t, h, 512}, q->options());
  at::Tensor lse_t = lse ? *lse : at::empty({t, h}, q->options().dtype(at::kFloat));
  Values v;
  v.raw[IDX] = pi;
  v.raw[VC] = pv;
  v.slot[SCALE] = PyFloat_FromDouble(sm_scale * LOG2E);  // the Python path's float(sm_scale) * LOG2E
  return replay(e, v, pq, pq + static_cast<uint64_t>(e.qr_offset), pr, ks, std::move(out_t), std::move(lse_t));
}

// An int attribute of `o` (false where it is missing or not an int).
bool int_attr(PyObject* o, PyObject* name, int64_t* v) {
  PyObject* x = PyObject_GetAttr(o, name);
  if (x == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool ok = PyLong_CheckExact(x);
  if (ok) *v = PyLong_AsLongLong(x);
  Py_DECREF(x);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return ok;
}

PyObject* run_impl(PyObject* const* a, Py_ssize_t n) {
  if (n != 7 || g_cache_type == nullptr) Py_RETURN_NONE;
  PyObject *runner = a[0], *qo = a[1], *cache = a[2], *to = a[3], *ks = a[4], *outo = a[5], *lseo = a[6];
  if (!scale(ks, nullptr)) Py_RETURN_NONE;
  PyObject* planned = PyObject_GetAttr(runner, g_str_planned);
  if (planned == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  Py_DECREF(planned);  // identity only (a recorded entry owns a reference to its plan)
  if (planned == Py_None) Py_RETURN_NONE;
  const at::Tensor* q;
  int64_t t, h, d;
  if (!query(qo, &q, &t, &h, &d)) Py_RETURN_NONE;
  const at::Device dev = q->device();
  const at::Tensor* topk = plain(to);
  if (topk == nullptr || topk->dim() != 2 || topk->scalar_type() != at::kInt || topk->size(0) != t || topk->device() != dev)
    Py_RETURN_NONE;
  const at::Tensor *out, *lse;
  uint64_t pr = 0;
  PyObject* fmt = nullptr;
  if (!outputs(outo, lseo, t, h, dev, &out, &lse) || !cache_parts(cache, dev, &pr, &fmt)) Py_RETURN_NONE;
  int64_t block_size, block_stride, num_blocks;
  if (!int_attr(cache, g_str_block_size, &block_size) || !int_attr(cache, g_str_block_stride, &block_stride) ||
      !int_attr(cache, g_str_num_blocks, &num_blocks))
    Py_RETURN_NONE;
  long long stream = 0;
  const int ready = ready_on(dev, &stream);
  if (ready < 0) return nullptr;
  if (ready == 0) Py_RETURN_NONE;
  const long long qdev = dev.is_cuda() ? dev.index() : -1;

  const uint64_t pq = address(*q), pt = address(*topk);
  uint64_t align = pq | pr | pt;
  if (out) align |= address(*out);
  if (lse) align |= address(*lse);
  if (align & 15) Py_RETURN_NONE;

  Key key;
  int64_t* w = key.w;
  w[0] = 2;  // SparseMLA.run
  w[1] = reinterpret_cast<int64_t>(runner);
  w[2] = reinterpret_cast<int64_t>(planned);
  w[3] = t; w[4] = h; w[5] = d;
  w[6] = q->stride(0); w[7] = q->stride(1);
  w[8] = topk->size(1); w[9] = topk->stride(0); w[10] = topk->stride(1);
  w[11] = out != nullptr; w[12] = out ? out->stride(0) : 0; w[13] = out ? out->stride(1) : 0;
  w[14] = lse != nullptr; w[15] = lse ? lse->stride(0) : 0; w[16] = lse ? lse->stride(1) : 0;
  w[17] = reinterpret_cast<int64_t>(fmt); w[18] = block_size; w[19] = block_stride;
  w[20] = qdev; w[21] = stream;
  auto it = g_entries.find(key);
  if (it == g_entries.end()) return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(key.w));
  const std::shared_ptr<Entry> held = it->second;
  const Entry& e = *held;
  if (num_blocks <= e.max_block || (out == nullptr && e.out == nullptr) || (lse == nullptr && e.lse == nullptr))
    Py_RETURN_NONE;  // a cache too small for the planned blocks: the Python path raises
  at::Tensor out_t = out ? *out : THPVariable_Unpack(e.out);
  at::Tensor lse_t = lse ? *lse : THPVariable_Unpack(e.lse);
  Values v;
  v.raw[TOPK] = pt;
  return replay(e, v, pq, pq + static_cast<uint64_t>(e.qr_offset), pr, ks, std::move(out_t), std::move(lse_t));
}

// One vLLM layer's call (sparsemla.integrations.vllm.LayerAttention.forward, the native backend): the outputs are
// the workspace's views for t tokens, kept by the record; q is one tensor or a (ql_nope, q_pe) pair.
PyObject* layer_impl(PyObject* const* a, Py_ssize_t n) {
  if (n != 8 || g_cache_type == nullptr) Py_RETURN_NONE;
  PyObject *ws = a[0], *config = a[1], *qo = a[2], *kvo = a[3], *io = a[4], *vco = a[5], *sm = a[6], *ks = a[7];
  double sm_scale;
  if (!scale(sm, &sm_scale) || !scale(ks, nullptr)) Py_RETURN_NONE;
  const at::Tensor *q, *qpe = nullptr;
  int64_t t, h, d, dpe = 0;
  if (PyTuple_CheckExact(qo)) {  // vLLM's (ql_nope, q_pe): both read in place
    if (PyTuple_GET_SIZE(qo) != 2 || !query(PyTuple_GET_ITEM(qo, 0), &q, &t, &h, &d)) Py_RETURN_NONE;
    int64_t t2, h2;
    if (!query(PyTuple_GET_ITEM(qo, 1), &qpe, &t2, &h2, &dpe) || t2 != t || h2 != h || dpe < 1 ||
        qpe->device() != q->device())
      Py_RETURN_NONE;  // (a NoPE pair, whose q_pe is not read, takes the Python path)
  } else if (!query(qo, &q, &t, &h, &d)) {
    Py_RETURN_NONE;
  }
  const at::Device dev = q->device();
  const at::Tensor* kv = plain(kvo);
  if (kv == nullptr || (kv->dim() != 3 && kv->dim() != 4) || kv->device() != dev) Py_RETURN_NONE;
  const at::Tensor *idx, *vc;
  if (!index_parts(io, vco, t, dev, &idx, &vc)) Py_RETURN_NONE;
  long long stream = 0;
  const int ready = ready_on(dev, &stream);
  if (ready < 0) return nullptr;
  if (ready == 0) Py_RETURN_NONE;
  const long long qdev = dev.is_cuda() ? dev.index() : -1;

  const uint64_t pq = address(*q), pqr = qpe ? address(*qpe) : 0, pr = address(*kv), pi = address(*idx),
                 pv = vc ? address(*vc) : pi;
  if ((pq | pqr | pr | pi | pv) & 15) Py_RETURN_NONE;

  Key key;
  int64_t* w = key.w;
  w[0] = 3;  // a vLLM layer
  w[1] = reinterpret_cast<int64_t>(ws);      // the workspace (its outputs, plans and partials)
  w[2] = reinterpret_cast<int64_t>(config);  // the layers' shared settings (cache dtype, head size, model dtype)
  w[3] = t; w[4] = h; w[5] = d;
  w[6] = q->stride(0); w[7] = q->stride(1);
  w[8] = dpe; w[9] = qpe ? qpe->stride(0) : 0; w[10] = qpe ? qpe->stride(1) : 0;
  w[11] = idx->size(1); w[12] = idx->stride(0);
  w[13] = vc != nullptr;
  w[14] = static_cast<int64_t>(kv->scalar_type()); w[15] = kv->dim();
  for (int64_t i = 0; i < kv->dim(); ++i) {  // (the format was checked against this geometry when recorded)
    w[16 + i] = kv->size(i);
    w[20 + i] = kv->stride(i);
  }
  w[24] = qdev; w[25] = stream;
  auto it = g_entries.find(key);
  if (it == g_entries.end()) return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(w), sizeof(key.w));
  const std::shared_ptr<Entry> held = it->second;
  const Entry& e = *held;
  if (e.out == nullptr || e.lse == nullptr) Py_RETURN_NONE;
  Values v;
  v.raw[IDX] = pi;
  v.raw[VC] = pv;
  v.slot[SCALE] = PyFloat_FromDouble(sm_scale * LOG2E);
  return replay(e, v, pq, qpe ? pqr : pq + static_cast<uint64_t>(e.qr_offset), pr, ks, THPVariable_Unpack(e.out),
                THPVariable_Unpack(e.lse));
}

// An entry point: `impl`, with a C++ exception (a tensor property torch refuses, an allocation that failed, ...)
// sending the call to the Python path, which serves it or raises.
//   call(mode, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)
//   run(runner, q, cache, topk_local, k_scale, out, lse)          (SparseMLA.run)
//   layer(workspace, config, q, kv_cache, indices, valid_counts, sm_scale, k_scale)   (vLLM's LayerAttention)
//   -> (out, lse) replayed | bytes (eligible, not recorded) | None (the Python path)
template <PyObject* (*impl)(PyObject* const*, Py_ssize_t)>
PyObject* guarded(PyObject*, PyObject* const* a, Py_ssize_t n) {
  try {
    return impl(a, n);
  } catch (const std::exception&) {
    if (PyErr_Occurred()) PyErr_Clear();
    Py_RETURN_NONE;
  }
}

bool parse_args(PyObject* values, PyObject* kinds, Args* dst) {
  if (!PyTuple_Check(values) || !PyTuple_Check(kinds) || PyTuple_GET_SIZE(values) != PyTuple_GET_SIZE(kinds)) {
    PyErr_SetString(PyExc_TypeError, "record: values and kinds must be tuples of one length");
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(values);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long k = PyLong_AsLong(PyTuple_GET_ITEM(kinds, i));
    if (k < 0 || k >= NUM_SLOTS) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "record: a kind out of range");
      return false;
    }
    PyObject* v = PyTuple_GET_ITEM(values, i);
    int64_t off = 0;
    if (k == CONST) {
      Py_INCREF(v);
    } else {  // a slot: its value is the offset (an int; 0 for the scales)
      off = PyLong_AsLongLong(v);
      if (PyErr_Occurred()) return false;
      if (off != 0 && (k == SCALE || k == KSCALE)) {
        PyErr_SetString(PyExc_ValueError, "record: a scale slot with an offset");
        return false;
      }
      v = nullptr;
    }
    dst->value.push_back(v);
    dst->kind.push_back(static_cast<int>(k));
    dst->offset.push_back(off);
  }
  return true;
}

// record(key: bytes, qr_offset: int, keep: object, launches: tuple of
//        (fn, outer_values, outer_kinds, inner_values or None, inner_kinds or None),
//        out: tensor or None, lse: tensor or None, max_block: int)
PyObject* record(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 7 || !PyBytes_Check(a[0]) || PyBytes_GET_SIZE(a[0]) != static_cast<Py_ssize_t>(sizeof(Key::w)) ||
      !PyTuple_Check(a[3]) || (a[4] != Py_None && !THPVariable_CheckExact(a[4])) ||
      (a[5] != Py_None && !THPVariable_CheckExact(a[5]))) {
    PyErr_SetString(PyExc_TypeError, "record(key, qr_offset, keep, launches, out, lse, max_block)");
    return nullptr;
  }
  Key key;
  std::memcpy(key.w, PyBytes_AS_STRING(a[0]), sizeof(key.w));
  std::shared_ptr<Entry> held(new Entry(), Release());
  Entry& e = *held;
  e.qr_offset = PyLong_AsLongLong(a[1]);
  e.max_block = PyLong_AsLongLong(a[6]);
  if (PyErr_Occurred()) return nullptr;
  if (a[4] != Py_None) {
    e.out = a[4];
    Py_INCREF(e.out);
  }
  if (a[5] != Py_None) {
    e.lse = a[5];
    Py_INCREF(e.lse);
  }
  const Py_ssize_t nl = PyTuple_GET_SIZE(a[3]);
  bool ok = nl >= 1;
  for (Py_ssize_t i = 0; ok && i < nl; ++i) {
    PyObject* l = PyTuple_GET_ITEM(a[3], i);
    if (!PyTuple_Check(l) || PyTuple_GET_SIZE(l) != 5) { ok = false; break; }
    e.launches.emplace_back();
    LaunchRec& rec = e.launches.back();
    rec.fn = PyTuple_GET_ITEM(l, 0);
    Py_INCREF(rec.fn);
    ok = parse_args(PyTuple_GET_ITEM(l, 1), PyTuple_GET_ITEM(l, 2), &rec.outer);
    if (ok && PyTuple_GET_ITEM(l, 3) != Py_None) {
      rec.packed = true;
      ok = parse_args(PyTuple_GET_ITEM(l, 3), PyTuple_GET_ITEM(l, 4), &rec.inner);
    }
    ok = ok && rec.outer.kind.size() + 1 <= static_cast<size_t>(MAX_ARGS);
  }
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "record: malformed launches");
    return nullptr;
  }
  e.keep = a[2];
  Py_INCREF(e.keep);
  if (g_entries.size() >= MAX_ENTRIES) clear_entries();
  g_entries[key] = std::move(held);
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  clear_entries();
  Py_RETURN_NONE;
}

PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(g_entries.size()); }

// forget(owner_id): drop the records of one SparseMLA or one vLLM workspace (keyed by its id).
PyObject* forget(PyObject*, PyObject* arg) {
  const long long id = PyLong_AsLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  Map dropped;  // (released after the map is consistent again)
  for (auto it = g_entries.begin(); it != g_entries.end();) {
    if ((it->first.w[0] == 2 || it->first.w[0] == 3) && it->first.w[1] == id) {
      dropped.emplace(it->first, std::move(it->second));
      it = g_entries.erase(it);
    } else {
      ++it;
    }
  }
  Py_RETURN_NONE;
}

// configure(cache_type, get_device, get_stream, capturing, runtime, local, scale_min, scale_max, allow_cpu)
PyObject* configure(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 9 || !PyCallable_Check(a[1]) || !PyCallable_Check(a[2]) || !PyCallable_Check(a[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "configure(cache_type, get_device, get_stream, capturing, runtime, local, scale_min, scale_max, "
                    "allow_cpu)");
    return nullptr;
  }
  const double lo = PyFloat_AsDouble(a[6]), hi = PyFloat_AsDouble(a[7]);
  const int cpu = PyObject_IsTrue(a[8]);
  if (PyErr_Occurred() || cpu < 0) return nullptr;
  clear_entries();
  PyObject** slots[] = {&g_cache_type, &g_get_device, &g_get_stream, &g_capturing, &g_runtime, &g_local};
  for (int i = 0; i < 6; ++i) {
    Py_INCREF(a[i]);
    Py_XSETREF(*slots[i], a[i]);
  }
  g_scale_min = lo;
  g_scale_max = hi;
  g_allow_cpu = cpu != 0;
  if (g_str_enter == nullptr) {
    g_str_enter = PyUnicode_InternFromString("launch_enter_hook");
    g_str_exit = PyUnicode_InternFromString("launch_exit_hook");
    g_str_calls = PyUnicode_InternFromString("calls");
    g_str_per_call = PyUnicode_InternFromString("per_call");
    g_str_rows = PyUnicode_InternFromString("rows");
    g_str_fmt = PyUnicode_InternFromString("fmt");
    g_str_planned = PyUnicode_InternFromString("_planned");
    g_str_block_size = PyUnicode_InternFromString("block_size");
    g_str_block_stride = PyUnicode_InternFromString("block_stride_rows");
    g_str_num_blocks = PyUnicode_InternFromString("num_blocks");
  }
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guarded<call_impl>)), METH_FASTCALL,
     "call(mode, q, cache, indices, sm_scale, valid_counts, k_scale, backend, out, lse, check)"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guarded<run_impl>)), METH_FASTCALL,
     "run(runner, q, cache, topk_local, k_scale, out, lse)"},
    {"layer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(guarded<layer_impl>)), METH_FASTCALL,
     "layer(workspace, config, q, kv_cache, indices, valid_counts, sm_scale, k_scale)"},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(record)), METH_FASTCALL,
     "record(key, qr_offset, keep, launches, out, lse, max_block)"},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(configure)), METH_FASTCALL,
     "configure(cache_type, get_device, get_stream, capturing, runtime, local, scale_min, scale_max, allow_cpu)"},
    {"clear", clear, METH_NOARGS, "forget every recorded configuration"},
    {"size", size, METH_NOARGS, "the number of recorded configurations"},
    {"forget", forget, METH_O, "forget(owner_id): drop the records of one SparseMLA or vLLM workspace"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "sparsemla_host_entry", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define SPARSEMLA_CAT2(a, b) a##b
#define SPARSEMLA_CAT(a, b) SPARSEMLA_CAT2(a, b)
PyMODINIT_FUNC SPARSEMLA_CAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&kModule); }
