/* A launcher for one compiled Triton kernel: argument packing and cuLaunchKernel, nothing
 * else (see launcher.py for what it leaves out and why that is safe there).
 *
 * Launcher(function, device, block_x, shared_bytes, kinds, guards) makes one (device: the
 * ordinal the binary is loaded on); calling it as
 * launcher(grid_x, grid_y, grid_z, stream, *args) launches and returns True, where args are
 * every parameter of the kernel in order (constexprs included, as Triton's own launcher
 * takes them). guards holds a (dtype, aligned) pair for each of the leading tensor
 * arguments the binary was compiled for: where one's dtype is another object or its
 * address's 16-byte alignment differs, the call launches nothing and returns False (the
 * caller then finds the binary for it). kinds holds one character per parameter:
 *   'P' pointer: a tensor (its data_ptr()), an int, or None (null)
 *   'b' int8/bool  'h' int16  'i' int32  'l' int64  'B' uint8  'H' uint16  'I' uint32
 *   'L' uint64  'e' fp16  'E' bf16  'f' fp32  'd' fp64  'C' constexpr (not passed)
 * Two pointers follow the kernel's own parameters: the global and profile scratch buffers
 * Triton 3.6 appends to every kernel. The profile one is null (launcher.py declines kernels
 * that use it). The global one is null unless Launcher's scratch=(bytes_per_program,
 * allocate) is given (device-side tensor descriptors are written there): then a launch
 * needs grid x num_ctas x bytes_per_program bytes of it, taken from a buffer kept per
 * (device, stream), because allocating it on every call through Triton's allocator costs
 * more host time than the rest of the launch. allocate(nbytes) returns an object with
 * data_ptr() (a torch tensor made on the launch's stream, which is the current one); a
 * kept buffer is used only by launches on its stream, which run in order, and replaced
 * (the old one freed to torch's allocator on the stream it was made on) when a launch needs
 * more. While the stream is being captured into a CUDA graph, each launch takes a fresh
 * buffer, as Triton's launcher does, so no graph holds an address eager launches reuse.
 *
 * libcuda is opened at the first launch, not at import, so the module loads (and its
 * packing can be tested through pack()) where no driver is installed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 256

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned shared, void *stream,
                         void **params, void **extra);
typedef int (*ctx_get_fn)(void **ctx);
typedef int (*ctx_set_fn)(void *ctx);
typedef int (*device_get_fn)(int *device, int ordinal);
typedef int (*primary_retain_fn)(void **ctx, int device);
typedef int (*error_string_fn)(int code, const char **text);
typedef int (*is_capturing_fn)(void *stream, int *status);

static launch_fn cu_launch = NULL;
static ctx_get_fn cu_ctx_get_current = NULL;
static ctx_set_fn cu_ctx_set_current = NULL;
static device_get_fn cu_device_get = NULL;
static primary_retain_fn cu_primary_ctx_retain = NULL;
static error_string_fn cu_get_error_string = NULL;
static is_capturing_fn cu_stream_is_capturing = NULL;
static PyObject *data_ptr_name = NULL;
static PyObject *dtype_name = NULL;

static int load_driver(void) {
  if (cu_launch != NULL)
    return 0;
  void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "portable_kernels launcher: cannot open libcuda.so.1");
    return -1;
  }
  cu_ctx_get_current = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
  cu_get_error_string = (error_string_fn)dlsym(lib, "cuGetErrorString");
  cu_ctx_set_current = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
  cu_device_get = (device_get_fn)dlsym(lib, "cuDeviceGet");
  cu_primary_ctx_retain = (primary_retain_fn)dlsym(lib, "cuDevicePrimaryCtxRetain");
  cu_stream_is_capturing = (is_capturing_fn)dlsym(lib, "cuStreamIsCapturing");
  launch_fn launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
  if (launch == NULL || cu_ctx_get_current == NULL || cu_get_error_string == NULL ||
      cu_ctx_set_current == NULL || cu_device_get == NULL || cu_primary_ctx_retain == NULL ||
      cu_stream_is_capturing == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "portable_kernels launcher: libcuda.so.1 lacks cuLaunchKernel");
    return -1;
  }
  cu_launch = launch;
  return 0;
}

typedef union {
  uint64_t u64;
  int64_t i64;
  uint32_t u32;
  int32_t i32;
  uint16_t u16;
  int16_t i16;
  uint8_t u8;
  int8_t i8;
  float f32;
  double f64;
} Slot;

typedef struct {
  PyObject_HEAD
  void *function;
  unsigned block_x;
  unsigned shared;
  int device;  /* the ordinal the binary is loaded on */
  Py_ssize_t n_args;
  char kinds[MAX_PARAMS];
  Py_ssize_t n_guards;
  PyObject *dtypes[MAX_PARAMS];  /* owned references */
  char aligned[MAX_PARAMS];
  unsigned long long scratch_bytes;  /* global scratch per program; 0: none */
  PyObject *allocate;                /* owned; NULL without scratch */
  vectorcallfunc vectorcall;
} Launcher;

/* Global scratch kept per (device, stream), shared by every Launcher (launches on one stream
 * run in order, so one buffer serves them all). Past MAX_KEPT streams the oldest entry is
 * replaced. */
#define MAX_KEPT 16

typedef struct {
  int device;
  void *stream;
  unsigned long long bytes;
  uint64_t ptr;
  PyObject *owner; /* NULL: the slot is free */
} Kept;

static Kept kept[MAX_KEPT];
static int kept_next = 0;

/* The address of a new buffer of nbytes from allocate(nbytes), its owner in *owner (a new
 * reference); 0 with an error set. */
static uint64_t allocate_scratch(PyObject *allocate, unsigned long long nbytes, PyObject **owner) {
  PyObject *buf = PyObject_CallFunction(allocate, "K", nbytes);
  if (buf == NULL)
    return 0;
  PyObject *p = PyObject_CallMethodNoArgs(buf, data_ptr_name);
  if (p == NULL) {
    Py_DECREF(buf);
    return 0;
  }
  uint64_t ptr = PyLong_AsUnsignedLongLong(p);
  Py_DECREF(p);
  if (ptr == (uint64_t)-1 && PyErr_Occurred()) {
    Py_DECREF(buf);
    return 0;
  }
  if (ptr == 0 && nbytes > 0) {
    Py_DECREF(buf);
    PyErr_SetString(PyExc_RuntimeError, "launcher scratch: the allocator returned a null buffer");
    return 0;
  }
  *owner = buf;
  return ptr;
}

/* The global scratch address for a launch of nbytes on (device, stream). capturing: the
 * stream is being captured (a fresh buffer, returned in *fresh to be dropped after the
 * launch). 0 with an error set. */
static Kept *kept_slot(int device, void *stream) {
  for (int i = 0; i < MAX_KEPT; ++i)
    if (kept[i].owner != NULL && kept[i].device == device && kept[i].stream == stream)
      return &kept[i];
  return NULL;
}

static uint64_t scratch_for(PyObject *allocate, int device, void *stream, unsigned long long nbytes,
                            int capturing, PyObject **fresh) {
  *fresh = NULL;
  if (capturing)
    return allocate_scratch(allocate, nbytes, fresh);
  Kept *slot = kept_slot(device, stream);
  if (slot != NULL && slot->bytes >= nbytes)
    return slot->ptr;
  unsigned long long size = nbytes;
  if (slot != NULL && size < 2 * slot->bytes)
    size = 2 * slot->bytes; /* grow geometrically: a run of growing grids reallocates rarely */
  PyObject *owner = NULL;
  uint64_t ptr = allocate_scratch(allocate, size, &owner);
  if (ptr == 0)
    return 0;
  /* The allocator ran Python code, where another thread may have changed the slots: look
   * again. (A buffer replaced under another thread's launch is freed to torch's allocator
   * on its own stream, which reuses it only after that launch.) */
  slot = kept_slot(device, stream);
  if (slot == NULL) {
    for (int i = 0; i < MAX_KEPT && slot == NULL; ++i)
      if (kept[i].owner == NULL)
        slot = &kept[i];
    if (slot == NULL) {
      slot = &kept[kept_next];
      kept_next = (kept_next + 1) % MAX_KEPT;
    }
  }
  PyObject *old = slot->owner;
  slot->device = device;
  slot->stream = stream;
  slot->bytes = size;
  slot->ptr = ptr;
  slot->owner = owner;
  Py_XDECREF(old); /* after the slot is whole: freeing may run Python code */
  return ptr;
}

/* Whether args[i] is of the dtype and alignment the binary was compiled for; -1 on error. */
static int guard_holds(const Launcher *self, Py_ssize_t i, PyObject *obj, uint64_t ptr) {
  PyObject *dtype = PyObject_GetAttr(obj, dtype_name);
  if (dtype == NULL) {
    PyErr_Clear();  /* not a tensor where the binary had one: not this binary's call */
    return 0;
  }
  int same = dtype == self->dtypes[i];
  Py_DECREF(dtype);
  return same && ((ptr % 16 == 0) == self->aligned[i]);
}

static int pack_int_exact(PyObject *obj, char kind, Slot *slot, Py_ssize_t index);

/* Any integer-like value (numpy integers too, through __index__), as Triton's launcher
 * takes them. */
static int pack_int(PyObject *obj, char kind, Slot *slot, Py_ssize_t index) {
  if (PyLong_Check(obj))
    return pack_int_exact(obj, kind, slot, index);
  PyObject *exact = PyNumber_Index(obj);
  if (exact == NULL)
    return -1;
  int rc = pack_int_exact(exact, kind, slot, index);
  Py_DECREF(exact);
  return rc;
}

static int pack_int_exact(PyObject *obj, char kind, Slot *slot, Py_ssize_t index) {
  if (kind == 'L' || kind == 'P') {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
      return -1;
    slot->u64 = v;
    return 0;
  }
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred())
    return -1;
  long long lo, hi;
  switch (kind) {
    case 'b': lo = INT8_MIN; hi = INT8_MAX; slot->i8 = (int8_t)v; break;
    case 'h': lo = INT16_MIN; hi = INT16_MAX; slot->i16 = (int16_t)v; break;
    case 'i': lo = INT32_MIN; hi = INT32_MAX; slot->i32 = (int32_t)v; break;
    case 'B': lo = 0; hi = UINT8_MAX; slot->u8 = (uint8_t)v; break;
    case 'H': lo = 0; hi = UINT16_MAX; slot->u16 = (uint16_t)v; break;
    case 'I': lo = 0; hi = UINT32_MAX; slot->u32 = (uint32_t)v; break;
    default: slot->i64 = v; return 0;  /* 'l' */
  }
  if (v < lo || v > hi) {
    PyErr_Format(PyExc_OverflowError, "argument %zd: %lld does not fit its kernel parameter", index, v);
    return -1;
  }
  return 0;
}

/* Fills slots/params from args; returns the number of parameters, -1 with an error set, or
 * -2 where a guard of self (may be NULL) does not hold. */
static Py_ssize_t pack(const Launcher *self, const char *kinds, Py_ssize_t n_args,
                       PyObject *const *args, Slot *slots, void **params, uint64_t scratch) {
  Py_ssize_t n = 0;
  for (Py_ssize_t i = 0; i < n_args; ++i) {
    char kind = kinds[i];
    PyObject *obj = args[i];
    Slot *slot = &slots[n];
    if (kind == 'C')
      continue;
    if (kind == 'P') {
      if (obj == Py_None) {
        slot->u64 = 0;
      } else if (PyLong_Check(obj)) {
        if (pack_int(obj, 'P', slot, i) < 0)
          return -1;
      } else {
        PyObject *ptr = PyObject_CallMethodNoArgs(obj, data_ptr_name);
        if (ptr == NULL)
          return -1;
        int rc = pack_int(ptr, 'P', slot, i);
        Py_DECREF(ptr);
        if (rc < 0)
          return -1;
      }
      if (self != NULL && i < self->n_guards) {
        int holds = guard_holds(self, i, obj, slot->u64);
        if (holds <= 0)
          return holds < 0 ? -1 : -2;
      }
    } else if (kind == 'e' || kind == 'E' || kind == 'f' || kind == 'd') {
      double v = PyFloat_AsDouble(obj);
      if (v == -1.0 && PyErr_Occurred())
        return -1;
      if (kind == 'd') {
        slot->f64 = v;
      } else if (kind == 'f') {
        slot->f32 = (float)v;
      } else if (kind == 'E') {  /* bf16: the top half of the fp32 bits, as Triton packs it */
        float f = (float)v;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        slot->u16 = (uint16_t)(bits >> 16);
#if PY_VERSION_HEX < 0x030B0000
      } else if (_PyFloat_Pack2(v, (unsigned char *)&slot->u16, 1) < 0) {
#else
      } else if (PyFloat_Pack2(v, (char *)&slot->u16, 1) < 0) {
#endif
        return -1;
      }
    } else if (pack_int(obj, kind, slot, i) < 0) {
      return -1;
    }
    params[n] = slot;
    ++n;
  }
  /* Triton 3.6's global scratch pointer, then the profile one (null). */
  slots[n].u64 = scratch;
  params[n] = &slots[n];
  slots[n + 1].u64 = 0;
  params[n + 1] = &slots[n + 1];
  return n + 2;
}

static PyObject *launcher_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
  Launcher *self = (Launcher *)callable;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
    PyErr_SetString(PyExc_TypeError, "Launcher takes no keyword arguments");
    return NULL;
  }
  if (nargs != self->n_args + 4) {
    PyErr_Format(PyExc_TypeError, "Launcher takes %zd arguments (grid x, y, z, stream, then %zd "
                 "kernel arguments), got %zd", self->n_args + 4, self->n_args, nargs);
    return NULL;
  }
  unsigned grid[3];
  for (int d = 0; d < 3; ++d) {
    Slot dim;
    if (pack_int(args[d], 'I', &dim, d) < 0)
      return NULL;
    grid[d] = dim.u32;
  }
  void *stream = PyLong_AsVoidPtr(args[3]);
  if (stream == NULL && PyErr_Occurred())
    return NULL;
  Slot slots[MAX_PARAMS + 2];
  void *params[MAX_PARAMS + 2];
  Py_ssize_t packed = pack(self, self->kinds, self->n_args, args + 4, slots, params, 0);
  if (packed == -2)
    Py_RETURN_FALSE;
  if (packed < 0)
    return NULL;
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0)
    Py_RETURN_TRUE;
  if (load_driver() < 0)
    return NULL;
  PyObject *fresh = NULL; /* a capture's scratch, dropped after its launch */
  if (self->scratch_bytes) {
    int status = 0;
    /* An error (the legacy stream while another is captured globally) counts as capturing:
     * the launch then takes a fresh buffer, which is always safe. */
    int capturing = cu_stream_is_capturing(stream, &status) != 0 || status != 0;
    unsigned long long nbytes =
        (unsigned long long)grid[0] * grid[1] * grid[2] * self->scratch_bytes;
    uint64_t ptr = scratch_for(self->allocate, self->device, stream, nbytes, capturing, &fresh);
    if (ptr == 0)
      return NULL;
    slots[packed - 2].u64 = ptr;
  }
  void *ctx = NULL;
  int rc = cu_ctx_get_current(&ctx);
  if (rc == 0 && ctx == NULL) {
    /* A thread that has not made a CUDA runtime call yet (a user's worker, autograd's
     * device thread) has no current context: bind the device's primary one, which torch
     * and the binary use, as the runtime would at its first call. */
    int dev;
    rc = cu_device_get(&dev, self->device);
    if (rc == 0)
      rc = cu_primary_ctx_retain(&ctx, dev);
    if (rc == 0)
      rc = cu_ctx_set_current(ctx);
  }
  if (rc == 0)
    rc = cu_launch(self->function, grid[0], grid[1], grid[2], self->block_x, 1, 1, self->shared,
                   stream, params, NULL);
  Py_XDECREF(fresh);
  if (rc != 0) {
    const char *text = "unknown error";
    cu_get_error_string(rc, &text);
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s (%d)", text, rc);
    return NULL;
  }
  Py_RETURN_TRUE;
}

static PyObject *launcher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  unsigned long long function;
  unsigned block_x, shared;
  int device;
  const char *kinds;
  Py_ssize_t n_kinds;
  PyObject *guards = NULL, *scratch = NULL;
  static char *names[] = {"function", "device", "block_x", "shared", "kinds", "guards", "scratch",
                          NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KiIIs#|O!O!", names, &function, &device,
                                   &block_x, &shared, &kinds, &n_kinds, &PyTuple_Type, &guards,
                                   &PyTuple_Type, &scratch))
    return NULL;
  unsigned long long scratch_bytes = 0;
  PyObject *allocate = NULL;
  if (scratch != NULL) {
    if (!PyArg_ParseTuple(scratch, "KO", &scratch_bytes, &allocate))
      return NULL;
    if (!PyCallable_Check(allocate)) {
      PyErr_SetString(PyExc_TypeError, "scratch: a (bytes_per_program, allocate) pair");
      return NULL;
    }
  }
  Py_ssize_t n_guards = guards == NULL ? 0 : PyTuple_GET_SIZE(guards);
  if (n_guards > n_kinds) {
    PyErr_SetString(PyExc_ValueError, "more guards than kernel parameters");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n_guards; ++i) {
    PyObject *guard = PyTuple_GET_ITEM(guards, i);
    if (!PyTuple_Check(guard) || PyTuple_GET_SIZE(guard) != 2 || kinds[i] != 'P') {
      PyErr_Format(PyExc_ValueError, "guard %zd: a (dtype, aligned) pair for a pointer parameter", i);
      return NULL;
    }
  }
  if (n_kinds > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "at most %d kernel parameters, got %zd", MAX_PARAMS, n_kinds);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n_kinds; ++i) {
    if (strchr("PbhilBHILeEfdC", kinds[i]) == NULL || kinds[i] == '\0') {
      PyErr_Format(PyExc_ValueError, "unknown parameter kind %c at %zd", kinds[i], i);
      return NULL;
    }
  }
  Launcher *self = (Launcher *)type->tp_alloc(type, 0);
  if (self == NULL)
    return NULL;
  self->function = (void *)(uintptr_t)function;
  self->device = device;
  self->block_x = block_x;
  self->shared = shared;
  self->n_args = n_kinds;
  memcpy(self->kinds, kinds, (size_t)n_kinds);
  self->n_guards = n_guards;
  for (Py_ssize_t i = 0; i < n_guards; ++i) {
    PyObject *guard = PyTuple_GET_ITEM(guards, i);
    self->dtypes[i] = PyTuple_GET_ITEM(guard, 0);
    Py_INCREF(self->dtypes[i]);
    self->aligned[i] = (char)PyObject_IsTrue(PyTuple_GET_ITEM(guard, 1));
  }
  self->scratch_bytes = scratch_bytes;
  self->allocate = scratch_bytes ? Py_NewRef(allocate) : NULL;
  self->vectorcall = launcher_vectorcall;
  return (PyObject *)self;
}

static void launcher_dealloc(PyObject *obj) {
  Launcher *self = (Launcher *)obj;
  for (Py_ssize_t i = 0; i < self->n_guards; ++i)
    Py_DECREF(self->dtypes[i]);
  Py_XDECREF(self->allocate);
  Py_TYPE(obj)->tp_free(obj);
}

static PyTypeObject LauncherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "portable_kernels_launcher.Launcher",
    .tp_basicsize = sizeof(Launcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Launcher, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = launcher_new,
    .tp_dealloc = launcher_dealloc,
    .tp_doc = "One compiled kernel's launch: Launcher(function, device, block_x, shared, kinds, "
              "guards=(), scratch=None)",
};

/* pack(kinds, *args) -> bytes: the parameter buffer a launch would pass, each parameter in
 * its own 8-byte slot, the two scratch pointers last (for tests, no driver needed). */
static PyObject *pack_for_test(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1 || !PyUnicode_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "pack(kinds, *args)");
    return NULL;
  }
  Py_ssize_t n_kinds;
  const char *kinds = PyUnicode_AsUTF8AndSize(args[0], &n_kinds);
  if (kinds == NULL)
    return NULL;
  if (n_kinds != nargs - 1 || n_kinds > MAX_PARAMS) {
    PyErr_SetString(PyExc_TypeError, "pack: one argument per kind");
    return NULL;
  }
  Slot slots[MAX_PARAMS + 2];
  void *params[MAX_PARAMS + 2];
  memset(slots, 0, sizeof(slots));
  Py_ssize_t n = pack(NULL, kinds, n_kinds, args + 1, slots, params, 0);
  if (n < 0)
    return NULL;
  return PyBytes_FromStringAndSize((const char *)slots, n * (Py_ssize_t)sizeof(Slot));
}

/* scratch(allocate, device, stream, nbytes, capturing) -> address: the global scratch a
 * launch would take, through the kept buffers (for tests, no driver needed). */
static PyObject *scratch_for_test(PyObject *module, PyObject *args) {
  PyObject *allocate;
  int device, capturing;
  unsigned long long stream, nbytes;
  if (!PyArg_ParseTuple(args, "OiKKp", &allocate, &device, &stream, &nbytes, &capturing))
    return NULL;
  PyObject *fresh = NULL;
  uint64_t ptr = scratch_for(allocate, device, (void *)(uintptr_t)stream, nbytes, capturing, &fresh);
  Py_XDECREF(fresh);
  return ptr == 0 ? NULL : PyLong_FromUnsignedLongLong(ptr);
}

/* kept() -> [(device, stream, bytes)]: the kept buffers (for tests). */
static PyObject *kept_for_test(PyObject *module, PyObject *unused) {
  PyObject *out = PyList_New(0);
  for (int i = 0; out != NULL && i < MAX_KEPT; ++i) {
    if (kept[i].owner == NULL)
      continue;
    PyObject *entry = Py_BuildValue("(iKK)", kept[i].device, (unsigned long long)(uintptr_t)kept[i].stream,
                                    kept[i].bytes);
    if (entry == NULL || PyList_Append(out, entry) < 0) {
      Py_XDECREF(entry);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(entry);
  }
  return out;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack_for_test, METH_FASTCALL, "pack(kinds, *args) -> bytes"},
    {"scratch", scratch_for_test, METH_VARARGS,
     "scratch(allocate, device, stream, nbytes, capturing) -> address"},
    {"kept", kept_for_test, METH_NOARGS, "kept() -> [(device, stream, bytes)]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "portable_kernels_launcher", NULL, -1,
                                        methods};

PyMODINIT_FUNC PyInit_portable_kernels_launcher(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  dtype_name = PyUnicode_InternFromString("dtype");
  if (data_ptr_name == NULL || dtype_name == NULL || PyType_Ready(&LauncherType) < 0)
    return NULL;
  PyObject *module = PyModule_Create(&module_def);
  if (module == NULL)
    return NULL;
  Py_INCREF(&LauncherType);
  if (PyModule_AddObject(module, "Launcher", (PyObject *)&LauncherType) < 0) {
    Py_DECREF(&LauncherType);
    Py_DECREF(module);
    return NULL;
  }
  return module;
}
