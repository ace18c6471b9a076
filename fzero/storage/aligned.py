"""Buffers and sizes aligned for O_DIRECT.

O_DIRECT moves bytes between the device and the caller's memory without the page cache, which is what lets
offload stream far more data than fits in RAM without evicting everything else. The price is alignment: the
buffer's address, the file offset and the length must all be multiples of the device's logical block size.
4096 bytes covers every current NVMe and filesystem block size, so the whole layer uses it.

torch's CPU allocator aligns to 64 bytes only, hence `aligned_empty`: over-allocate by one alignment unit and
slice from the first aligned address. The slice is a view, which keeps the whole allocation alive.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from ..host.scratch import mapped_storage

__all__ = ["ALIGN", "aligned_empty", "buffer_address", "mapped_empty", "round_up", "tensor_bytes"]

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    """The smallest multiple of `align` that is at least `n`.

    Args:
        n: a byte count, at least 0.
        align: the alignment, positive.

    Returns:
        `n` rounded up to a multiple of `align`.
    """
    if n < 0:
        raise ValueError(f"round_up: n must be >= 0, got {n}")
    if align <= 0:
        raise ValueError(f"round_up: align must be positive, got {align}")
    return -(-n // align) * align


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `round_up(nbytes)` bytes whose `data_ptr()` is a multiple of `ALIGN`.

    O_DIRECT needs the buffer address, file offset and length aligned; the rounded-up length lets the last,
    partial block of a transfer be read or written whole.

    Args:
        nbytes: the bytes needed, at least 0.

    Returns:
        An uninitialised tensor (a view into a slightly larger allocation, which it keeps alive).
    """
    size = round_up(nbytes)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    out = raw[skip : skip + size]
    assert out.data_ptr() % ALIGN == 0
    return out


def mapped_empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `round_up(nbytes)` bytes in a private anonymous mapping of its own (page-aligned,
    so `ALIGN`-aligned), unmapped as soon as the last tensor on it goes: its memory goes back to the system then,
    where the C heap would keep a freed block resident (`fzero.host.heap`). Its pages are mapped on first touch. Off
    platforms without anonymous mappings, `aligned_empty`'s.

    Args:
        nbytes: the bytes needed, at least 0.

    Returns:
        An uninitialised tensor (zeros until written, on Linux).
    """
    size = round_up(nbytes)
    if size == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return aligned_empty(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(mapped_storage(size))


def tensor_bytes(t: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """The first bytes of a contiguous CPU tensor, without a copy and for every dtype (bf16 included).

    The view does not keep the tensor alive: hold the tensor as long as the view is used.

    Args:
        t: a contiguous CPU tensor.
        nbytes: how many bytes, at most the tensor's; all of them when None.

    Returns:
        A writable, flat memoryview of unsigned bytes.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"tensor_bytes: need a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    size = t.numel() * t.element_size()
    n = size if nbytes is None else nbytes
    if not 0 <= n <= size:
        raise ValueError(f"tensor_bytes: asked for {n} bytes of a tensor of {size}")
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer (Include/pybuffer.h), stable since 3.3
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """The address of a memoryview's first byte.

    `ctypes.c_char.from_buffer` would do for writable buffers only; a write's source may be read-only (bytes), so
    this asks the buffer protocol directly.

    Args:
        view: any buffer.

    Returns:
        The address (0 for an empty buffer, which has none that matters).
    """
    if view.nbytes == 0:
        return 0
    buf = _PyBuffer()
    # PyBUF_SIMPLE; pythonapi functions hold the GIL and raise the Python exception a failure sets
    _get_buffer(view, ctypes.byref(buf), 0)
    try:
        return int(buf.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buf))
