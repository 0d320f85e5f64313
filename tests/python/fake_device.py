"""A DLPack producer that labels host memory with another device (a CUDA device on a machine
without one), so that tests can show tensors on the wrong device are refused before any access."""

import ctypes

import numpy as np


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int), ("dtype", _DType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


_CODES = {"i": 0, "u": 1, "f": 2}
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_noop = _Deleter(lambda p: None)


class OnDevice:
    """arr (numpy) presented as if it lived on (device_type, device_id); the memory is never
    released by the consumer (the object keeps it)."""

    def __init__(self, arr, device_type=2, device_id=0):
        self.arr = np.ascontiguousarray(arr)
        self.dev = (device_type, device_id)
        self._keep = []

    def __dlpack_device__(self):
        return self.dev

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        a = self.arr
        shape = (ctypes.c_int64 * a.ndim)(*a.shape)
        strides = (ctypes.c_int64 * a.ndim)(*[s // a.itemsize for s in a.strides])
        m = _Managed()
        m.dl_tensor = _Tensor(a.ctypes.data, _Device(*self.dev), a.ndim,
                              _DType(_CODES[a.dtype.kind], a.itemsize * 8, 1), shape, strides, 0)
        m.deleter = _noop
        self._keep += [shape, strides, m]
        return _capsule_new(ctypes.addressof(m), b"dltensor", None)
