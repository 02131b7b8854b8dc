/* A replay signature in C: the same key as portable_kernels._signature.python_signature
 * builds in Python, element for element (tests/test_signature.py compares the two on every
 * kind of argument). The key is most of the Python a replayed call runs before its
 * allocations and launches; here the tensors' getters are called without bytecode between
 * them.
 *
 * signature(args, kwargs, current) -> (key, pointers) or None
 *   args: the call's tuple; kwargs: its dict (may be empty); current: a callable giving
 *   the current device's index (several GPUs) or None.
 * init(tensor_types, context, grad_enabled) must be called once: the exact tensor classes
 * the key accepts, the selection context's ContextVar (its value leads the key) and
 * torch.is_grad_enabled.
 *
 * Only the CPython API: no torch headers, so it builds wherever Triton builds its own
 * launchers (with the same helper), for every vendor.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Up to this many addresses the sharing test compares them pairwise; more go through a set. */
#define MAX_TENSORS 16

static PyObject *tensor_types = NULL; /* a tuple of exact classes */
static PyObject *context_var = NULL;  /* a ContextVar with a default */
static PyObject *grad_enabled = NULL; /* torch.is_grad_enabled */
static PyObject *s_requires_grad, *s_data_ptr, *s_get_device, *s_device, *s_is_cuda, *s_type,
    *s_dtype, *s_shape, *s_stride;

static int is_tensor(PyObject *obj) {
  PyTypeObject *type = Py_TYPE(obj);
  Py_ssize_t n = PyTuple_GET_SIZE(tensor_types);
  for (Py_ssize_t i = 0; i < n; ++i)
    if ((PyObject *)type == PyTuple_GET_ITEM(tensor_types, i))
      return 1;
  return 0;
}

/* int, float, bool, str, None: exactly those classes (a subclass may hash as another). */
static int is_scalar(PyObject *obj) {
  return PyLong_CheckExact(obj) || PyFloat_CheckExact(obj) || PyBool_Check(obj) ||
         PyUnicode_CheckExact(obj) || obj == Py_None;
}

typedef struct {
  PyObject *key;      /* list */
  PyObject *pointers; /* list */
  int grad;
  PyObject *first;    /* the first tensor's device index (an int), or its device */
  unsigned long long ptrs[MAX_TENSORS];
  Py_ssize_t n_ptrs;
} State;

/* 1: appended; 0: the call has no signature; -1: error set. */
static int add_tensor(State *st, PyObject *a) {
  if (st->grad) {
    PyObject *rg = PyObject_GetAttr(a, s_requires_grad);
    if (rg == NULL)
      return -1;
    int wants = PyObject_IsTrue(rg);
    Py_DECREF(rg);
    if (wants)
      return wants < 0 ? -1 : 0;
  }
  PyObject *p = NULL, *index = NULL, *entry = NULL;
  int rc = -1;
  p = PyObject_CallMethodNoArgs(a, s_data_ptr);
  if (p == NULL)
    goto out;
  unsigned long long ptr = PyLong_AsUnsignedLongLong(p);
  if (ptr == (unsigned long long)-1 && PyErr_Occurred())
    goto out;
  index = PyObject_CallMethodNoArgs(a, s_get_device);
  if (index == NULL)
    goto out;
  long ix = PyLong_AsLong(index);
  if (ix == -1 && PyErr_Occurred())
    goto out;
  if (ix < 0) { /* the host, meta or another device without an index */
    Py_DECREF(index);
    index = PyObject_GetAttr(a, s_device);
    if (index == NULL)
      goto out;
  }
  if (st->first == NULL) {
    st->first = Py_NewRef(index);
    if (PyLong_CheckExact(index)) {  /* once: is_cuda is cheaper than the device's type */
      PyObject *kind = PyObject_GetAttr(a, s_is_cuda);
      if (kind == NULL)
        goto out;
      int truth = PyObject_IsTrue(kind);
      if (truth <= 0) {
        Py_DECREF(kind);
        if (truth < 0)
          goto out;
        PyObject *dev = PyObject_GetAttr(a, s_device);
        if (dev == NULL)
          goto out;
        kind = PyObject_GetAttr(dev, s_type);
        Py_DECREF(dev);
        if (kind == NULL)
          goto out;
      }
      int appended = PyList_Append(st->key, kind);
      Py_DECREF(kind);
      if (appended < 0)
        goto out;
    }
  } else if (Py_TYPE(index) != Py_TYPE(st->first)) {
    rc = 0; /* a host tensor beside device ones */
    goto out;
  } else if (!PyLong_CheckExact(index)) { /* devices without an index: of one type */
    PyObject *t1 = PyObject_GetAttr(index, s_type);
    PyObject *t0 = t1 == NULL ? NULL : PyObject_GetAttr(st->first, s_type);
    int same = t0 == NULL ? -1 : PyObject_RichCompareBool(t1, t0, Py_EQ);
    Py_XDECREF(t1);
    Py_XDECREF(t0);
    if (same <= 0) {
      rc = same;
      goto out;
    }
  }
  entry = PyTuple_New(5);
  if (entry == NULL)
    goto out;
  PyObject *item;
  if ((item = PyObject_GetAttr(a, s_dtype)) == NULL)
    goto out;
  PyTuple_SET_ITEM(entry, 0, item);
  if ((item = PyObject_GetAttr(a, s_shape)) == NULL)
    goto out;
  PyTuple_SET_ITEM(entry, 1, item);
  if ((item = PyObject_CallMethodNoArgs(a, s_stride)) == NULL)
    goto out;
  PyTuple_SET_ITEM(entry, 2, item);
  PyTuple_SET_ITEM(entry, 3, Py_NewRef(index));
  if ((item = PyLong_FromLong((long)(ptr & 15))) == NULL)
    goto out;
  PyTuple_SET_ITEM(entry, 4, item);
  if (PyList_Append(st->key, entry) < 0 || PyList_Append(st->pointers, p) < 0)
    goto out;
  if (st->n_ptrs < MAX_TENSORS)
    st->ptrs[st->n_ptrs] = ptr;
  st->n_ptrs++;
  rc = 1;
out:
  Py_XDECREF(entry);  /* a tuple with unset items is freed safely */
  Py_XDECREF(index);
  Py_XDECREF(p);
  return rc;
}

/* A non-empty list or tuple of tensors only (grouped_matmul's groups): (its type, its
 * length), then each tensor as an argument of its own. 1: appended; 0: no signature;
 * -1: error. */
static int add_tensors(State *st, PyObject *seq) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n == 0)
    return 0;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!is_tensor(PySequence_Fast_GET_ITEM(seq, i)))
      return 0;
  PyObject *head = Py_BuildValue("(On)", (PyObject *)Py_TYPE(seq), n);
  if (head == NULL)
    return -1;
  int rc = PyList_Append(st->key, head);
  Py_DECREF(head);
  if (rc < 0)
    return -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    /* A list's items may change under a getter (another thread): hold the one in hand. */
    if (PySequence_Fast_GET_SIZE(seq) != n)
      return 0;
    PyObject *t = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
    rc = add_tensor(st, t);
    Py_DECREF(t);
    if (rc <= 0)
      return rc;
  }
  return 1;
}

/* 1: appended; 0: no signature; -1: error. */
static int add_value(State *st, PyObject *a) {
  if (is_tensor(a))
    return add_tensor(st, a);
  if (is_scalar(a)) {
    if (PyList_Append(st->key, (PyObject *)Py_TYPE(a)) < 0 || PyList_Append(st->key, a) < 0)
      return -1;
    return 1;
  }
  if (PyList_CheckExact(a))
    return add_tensors(st, a);
  if (PyTuple_CheckExact(a)) {
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!is_scalar(PyTuple_GET_ITEM(a, i)))
        return add_tensors(st, a);
    PyObject *types = PyTuple_New(n);
    if (types == NULL)
      return -1;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject *t = (PyObject *)Py_TYPE(PyTuple_GET_ITEM(a, i));
      Py_INCREF(t);
      PyTuple_SET_ITEM(types, i, t);
    }
    int rc = PyList_Append(st->key, types);
    Py_DECREF(types);
    if (rc < 0 || PyList_Append(st->key, a) < 0)
      return -1;
    return 1;
  }
  return 0;
}

static PyObject *signature(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 3 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "signature(args: tuple, kwargs: dict, current)");
    return NULL;
  }
  if (tensor_types == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "signature: init() was not called");
    return NULL;
  }
  PyObject *args = argv[0], *kwargs = argv[1], *current = argv[2];
  PyObject *on = PyObject_CallNoArgs(grad_enabled);
  if (on == NULL)
    return NULL;
  int grad = PyObject_IsTrue(on);
  Py_DECREF(on);
  if (grad < 0)
    return NULL;
  PyObject *context;
  if (PyContextVar_Get(context_var, NULL, &context) < 0)
    return NULL;
  if (context == NULL) {
    PyErr_SetString(PyExc_LookupError, "signature: the selection context has no value");
    return NULL;
  }
  State st = {PyList_New(1), PyList_New(0), grad, NULL, {0}, 0};
  PyObject *result = NULL;
  if (st.key == NULL || st.pointers == NULL) {
    Py_DECREF(context);
    goto done;
  }
  PyList_SET_ITEM(st.key, 0, context);  /* the key owns it now */
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int rc = add_value(&st, PyTuple_GET_ITEM(args, i));
    if (rc <= 0) {
      if (rc == 0)
        result = Py_NewRef(Py_None);
      goto done;
    }
  }
  Py_ssize_t n_kw = PyDict_GET_SIZE(kwargs);
  if (n_kw > 0) {
    PyObject *names = PyTuple_New(n_kw);
    if (names == NULL)
      goto done;
    Py_ssize_t pos = 0, i = 0;
    PyObject *name, *value;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
      Py_INCREF(name);
      PyTuple_SET_ITEM(names, i++, name);
      int rc = add_value(&st, value);
      if (rc <= 0) {
        Py_DECREF(names);
        if (rc == 0)
          result = Py_NewRef(Py_None);
        goto done;
      }
    }
    int rc = PyList_Append(st.key, names);
    Py_DECREF(names);
    if (rc < 0)
      goto done;
  }
  int shared = 0;
  if (st.n_ptrs <= MAX_TENSORS) {
    for (Py_ssize_t i = 1; i < st.n_ptrs && !shared; ++i)
      for (Py_ssize_t j = 0; j < i; ++j)
        if (st.ptrs[i] == st.ptrs[j]) {
          shared = 1;
          break;
        }
  } else {
    PyObject *distinct = PySet_New(st.pointers);
    if (distinct == NULL)
      goto done;
    shared = PySet_GET_SIZE(distinct) < st.n_ptrs;
    Py_DECREF(distinct);
  }
  if (shared) { /* which arguments share an address: each one's first index */
    PyObject *firsts = PyDict_New();
    PyObject *which = firsts == NULL ? NULL : PyTuple_New(st.n_ptrs);
    int rc = which == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; i < st.n_ptrs && rc == 0; ++i) {
      PyObject *index = PyLong_FromSsize_t(i);
      PyObject *first = index == NULL ? NULL
                                      : PyDict_SetDefault(firsts, PyList_GET_ITEM(st.pointers, i), index);
      Py_XDECREF(index);
      if (first == NULL)
        rc = -1;
      else
        PyTuple_SET_ITEM(which, i, Py_NewRef(first));  /* a borrowed reference, made ours */
    }
    if (rc == 0)
      rc = PyList_Append(st.key, which);
    Py_XDECREF(which);
    Py_XDECREF(firsts);
    if (rc < 0)
      goto done;
  }
  if (current != Py_None) {
    PyObject *index = PyObject_CallNoArgs(current);
    if (index == NULL)
      goto done;
    int rc = PyList_Append(st.key, index);
    Py_DECREF(index);
    if (rc < 0)
      goto done;
  }
  PyObject *key = PyList_AsTuple(st.key);
  if (key != NULL) {
    result = PyTuple_Pack(2, key, st.pointers);
    Py_DECREF(key);
  }
done:
  Py_XDECREF(st.first);
  Py_XDECREF(st.key);
  Py_XDECREF(st.pointers);
  return result;
}

static PyObject *init(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 3 || !PyTuple_Check(argv[0]) || !PyContextVar_CheckExact(argv[1]) ||
      !PyCallable_Check(argv[2])) {
    PyErr_SetString(PyExc_TypeError, "init(tensor_types: tuple, context: ContextVar, grad_enabled)");
    return NULL;
  }
  Py_XDECREF(tensor_types);
  Py_XDECREF(context_var);
  Py_XDECREF(grad_enabled);
  tensor_types = Py_NewRef(argv[0]);
  context_var = Py_NewRef(argv[1]);
  grad_enabled = Py_NewRef(argv[2]);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"signature", (PyCFunction)(void (*)(void))signature, METH_FASTCALL,
     "signature(args, kwargs, current) -> (key, pointers) or None"},
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL, "init(tensor_types, context, grad_enabled)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "portable_kernels_signature", NULL, -1,
                                        methods};

PyMODINIT_FUNC PyInit_portable_kernels_signature(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
  INTERN(s_requires_grad, "requires_grad");
  INTERN(s_data_ptr, "data_ptr");
  INTERN(s_get_device, "get_device");
  INTERN(s_device, "device");
  INTERN(s_is_cuda, "is_cuda");
  INTERN(s_type, "type");
  INTERN(s_dtype, "dtype");
  INTERN(s_shape, "shape");
  INTERN(s_stride, "stride");
#undef INTERN
  return PyModule_Create(&module_def);
}
