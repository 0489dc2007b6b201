"""The field-aware FM's computation on a batch apart from where its parameters live (no MPI: used
to train, :class:`hpcps.train.models.FieldAwareFM`, and to serve, :class:`hpcps.train.models.Scorer`),
and each nonzero's field, read from its key's bits above ``data.hash_bits``."""

from __future__ import annotations

import numpy as np

from hpcps.train.data import BIAS_KEY
from hpcps_kernels import ffm as kffm


def field_error(field: int, fields: int) -> ValueError:
    """The error of a feature whose field is not among the model's ``fields``."""
    return ValueError(f"a feature of field {field} in a model of {fields} fields (model.fields = {fields}; a key's "
                      f"field is key >> data.hash_bits)")


def batch_fields(batch, shift: int, fields: int) -> np.ndarray:
    """Each nonzero's field (int32; -1 for the bias key) of a batch whose keys carry their field
    above ``shift`` bits; a ValueError names a field the model has not."""
    fld = np.empty(batch.indices.shape[0], dtype=np.int32)
    bad = kffm.nonzero_fields(batch.indices, shift, fields, BIAS_KEY, fld)
    if bad >= 0:
        raise field_error(int(batch.indices[bad]) >> shift, fields)
    return fld


def ffm_margins(batch, pos, params: np.ndarray, k: int, shift: int, fields: int) -> np.ndarray:
    """A field-aware FM's margins of ``batch`` given its keys' rows ``params`` (no servers)."""
    out = np.empty(batch.rows, dtype=np.float64)
    kffm.ffm_margins(batch.indptr, pos, batch_fields(batch, shift, fields), batch.values, params, k, out)
    return out
