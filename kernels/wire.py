"""16-bit wire types of float32 values (the parameter server's ``filters.wire_dtype``), one pass.

The encoders take float32 values as their uint32 bits and write uint16 words, rounded to the
nearest, ties to even; :func:`fp16_values` decodes fp16 (bfloat16 decodes by a shift). NumPy's ``astype(np.float16)`` converts in software at about 12 ns a value and a
NumPy bfloat16 needs four passes over temporaries; these take one pass. References:
:func:`hpcps_kernels.reference.fp16_bits` and :func:`~hpcps_kernels.reference.bf16_bits`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

FP16_MAX_BITS = 0x7BFF  # 65504, fp16's largest finite value


@njit(cache=True)
def fp16_bits(bits, out):
    """``out[i]``: float32 ``bits[i]`` as fp16, saturated at +-65504 (infinities too); NaN: a quiet NaN."""
    for i in range(bits.shape[0]):
        f = np.uint32(bits[i])
        sign = (f >> np.uint32(16)) & np.uint32(0x8000)
        a = f & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN
            h = np.uint32(0x7E00)
        elif a > np.uint32(0x477FE000):  # past 65504
            h = np.uint32(FP16_MAX_BITS)
        elif a >= np.uint32(0x38800000):  # fp16's normal range
            h = ((a >> np.uint32(23)) - np.uint32(112)) << np.uint32(10) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
            rest = a & np.uint32(0x1FFF)
            if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and h & np.uint32(1)):
                h += np.uint32(1)  # (a carry into the exponent is right; it cannot pass 65504)
        else:  # fp16's subnormals, or zero
            shift = np.uint32(126) - (a >> np.uint32(23))
            if shift > np.uint32(24):
                h = np.uint32(0)
            else:
                m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
                h = m >> shift
                rest = m & ((np.uint32(1) << shift) - np.uint32(1))
                half = np.uint32(1) << (shift - np.uint32(1))
                if rest > half or (rest == half and h & np.uint32(1)):
                    h += np.uint32(1)
        out[i] = np.uint16(sign | h)


@njit(cache=True)
def bf16_bits(bits, out):
    """``out[i]``: float32 ``bits[i]`` as bfloat16 (its upper half, rounded); NaN: a quiet NaN;
    values past bfloat16's range become infinities, as in float32 arithmetic."""
    for i in range(bits.shape[0]):
        f = np.uint32(bits[i])
        if f & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):
            out[i] = np.uint16((f >> np.uint32(16)) | np.uint32(0x40))
        else:
            out[i] = np.uint16((f + np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True)
def fp16_values(words, out):
    """``out[i]``: the float32 bits of fp16 word ``words[i]`` (exact: fp16 is a subset of float32)."""
    for i in range(words.shape[0]):
        h = np.uint32(words[i])
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        e = (h >> np.uint32(10)) & np.uint32(0x1F)
        m = h & np.uint32(0x3FF)
        if e == np.uint32(0x1F):  # infinities and NaN
            out[i] = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
        elif e != np.uint32(0):
            out[i] = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
        elif m == np.uint32(0):
            out[i] = sign
        else:  # a subnormal: normalised
            e = np.uint32(113)
            while m & np.uint32(0x400) == np.uint32(0):
                m <<= np.uint32(1)
                e -= np.uint32(1)
            out[i] = sign | (e << np.uint32(23)) | ((m & np.uint32(0x3FF)) << np.uint32(13))
