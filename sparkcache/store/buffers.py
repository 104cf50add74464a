"""What ``PageStore.publish`` takes as a page or a state: any C-contiguous buffer, by its bytes.

A page is stored as the bytes a buffer holds in row-major order, whatever its shape or item
format: a 2-D ``memoryview``, a typed one (``'f'``, ``'H'``), a numpy array, an
``array.array``. ``len()`` of such a buffer counts its first dimension or its items, not its
bytes, so every page is turned into a flat unsigned-byte view first and measured by that. A
buffer whose bytes are not one run in row-major order (strided, transposed, Fortran-ordered)
is refused: its memory is not the page it stands for.
"""

from __future__ import annotations

_FIX = ("pass a C-contiguous copy (numpy.ascontiguousarray(x), tensor.contiguous(), "
        "or bytes(x))")


def byte_view(buf: object, what: str) -> memoryview:
    """``buf`` as a flat memoryview of unsigned bytes (format ``'B'``, length = its bytes).
    ``what`` names it in errors ("page 3", "state"): a TypeError when it is not a buffer, a
    ValueError when it is not C-contiguous."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"publish: {what} is a {type(buf).__name__}, not a bytes-like object; "
                        "pass bytes, a bytearray, a memoryview or an array") from None
    if not view.c_contiguous:
        raise ValueError(f"publish: {what} is not C-contiguous (shape {view.shape}, strides "
                         f"{view.strides}): its bytes are not one run in row-major order. "
                         f"Fix: {_FIX}")
    if view.nbytes == 0:
        return memoryview(b"")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")
