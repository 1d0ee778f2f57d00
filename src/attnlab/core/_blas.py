"""NumPy's own BLAS ``sgemm``, for compiled kernels that multiply without coming back to
Python (:func:`attnlab.core._fused.forward_rows`, :func:`attnlab.core._fused.backward_rows`).

NumPy's wheels (2.0 and later) carry OpenBLAS as ``scipy-openblas64``, whose CBLAS
functions take 64-bit integers and have the symbol ``scipy_cblas_sgemm64_``. Where NumPy
was built against another BLAS (Accelerate, MKL, a 32-bit-integer OpenBLAS), there is no
such function and the callers keep their NumPy path. The library is the one NumPy has
loaded, found through ``threadpoolctl`` (a core dependency), so the thread count that
:mod:`attnlab._threads` sets on it holds for these calls too.
"""

from __future__ import annotations

import functools
import os

_SYMBOL = "scipy_cblas_sgemm64_"


@functools.cache
def sgemm_address() -> int:
    """The address of NumPy's ``cblas_sgemm`` with 64-bit integers, or 0 where there is
    none (see the module's note). Looked up once per process.

    >>> isinstance(sgemm_address(), int)
    True
    """
    try:
        import ctypes

        import numpy as np
        from threadpoolctl import threadpool_info
    except ImportError:
        return 0
    home = os.path.dirname(os.path.abspath(np.__file__))  # numpy/ and numpy.libs/ beside it
    for lib in threadpool_info():
        path = lib.get("filepath") or ""
        if lib.get("internal_api") != "openblas" or not os.path.abspath(path).startswith(home):
            continue
        try:
            fn = getattr(ctypes.CDLL(path), _SYMBOL)
        except (OSError, AttributeError):
            continue
        return ctypes.cast(fn, ctypes.c_void_p).value or 0
    return 0
