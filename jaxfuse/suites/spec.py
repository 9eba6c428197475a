"""What the project knows about one op, in one place: ``OpSpec`` (implementations from the site registry, named
shapes, inputs, floor, tolerance) and the tolerance rule the tests and the sweep share.

    from jaxfuse import suites
    spec = suites.get("attention")
    args, cotangent = spec.inputs(spec.shapes["cpu"], seed=0)
    tol = spec.tolerance(spec.shapes["cpu"])        # max |x − ref| / max |ref| allowed against the float32 reference

Tolerance rule (``tolerance``): a relative error (max |x − ref| / max |ref|) of ``BASE_TOLERANCE[dtype]`` up to
``REFERENCE_LENGTH`` summed terms, growing with the square root of the reduction length past it (as tokamax's
``atol = base · sqrt(n)``: independent rounding errors add up like a random walk). The base values are what the
kernel tests have always asserted; every test shape reduces over fewer than REFERENCE_LENGTH terms.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["BASE_TOLERANCE", "REFERENCE_LENGTH", "tolerance"]

BASE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
REFERENCE_LENGTH = 2**16


def tolerance(dtype, reduction_length: int = 1) -> float:
    """Largest relative error against the float32 reference for inputs of ``dtype`` reduced over
    ``reduction_length`` terms: BASE_TOLERANCE[dtype] · max(1, sqrt(reduction_length / REFERENCE_LENGTH))."""
    name = np.dtype(dtype).name
    if name not in BASE_TOLERANCE:
        raise ValueError(f"dtype: {name} has no tolerance; one of {sorted(BASE_TOLERANCE)}")
    return BASE_TOLERANCE[name] * max(1.0, math.sqrt(reduction_length / REFERENCE_LENGTH))
