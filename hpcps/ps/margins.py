"""The server functions of computation on the servers (``model.compute = "servers"``): LR's and
FM's partial margins and their gradients, registered as ``hpcps.margins`` and ``hpcps.residuals``
(:data:`~hpcps.ps.tables.MARGINS_FUNCTION`, :data:`~hpcps.ps.tables.RESIDUALS_FUNCTION`) in the
registry users register theirs in (:func:`hpcps.ps.tables.register_server_function`). A server
answers a ``MARGINS`` or ``RESIDUALS`` request (:mod:`hpcps.ps.protocol`) with the function
registered under that name, so the serving loop knows no model maths; a model of your own may
register its own under these names (``replace=True``, on every rank).

* ``margins(shard, keys, values, row_ids, out)``: each row's partial sums over the given
  nonzeros (this server's part of a batch) into ``out`` (float64, ``n_rows x
  protocol.margin_width(dim)``).
* ``residuals(shard, keys, values, row_ids, residuals)``: the nonzeros' gradients from each row's
  residuals (float64, ``n_rows x dim``), as ``(unique keys, gradients)``: the server pushes them.
"""

from __future__ import annotations

import numpy as np

from hpcps.ps.tables import MARGINS_FUNCTION, RESIDUALS_FUNCTION, register_server_function
from hpcps_kernels import keys as kkeys
from hpcps_kernels import models as kmodels


def partial_margins(shard, keys: np.ndarray, values: np.ndarray, row_ids: np.ndarray, out: np.ndarray) -> None:
    """LR's partial margin of each row (dim 1), or an FM's linear part, factor sums and sum of
    squares, over the given nonzeros, into ``out``."""
    dim = shard.spec.dim
    uniq, pos = kkeys.dedup_keys(keys)
    params = np.empty((uniq.shape[0], dim), dtype=np.float32)
    shard.pull(uniq, params)
    if dim == 1:
        kmodels.lr_partial_margins(pos, values, row_ids, params[:, 0], out.reshape(-1))
    else:
        kmodels.fm_partial_margins(pos, values, row_ids, params[:, 0], params[:, 1:], out)


def residual_grads(shard, keys: np.ndarray, values: np.ndarray, row_ids: np.ndarray, residuals: np.ndarray):
    """(unique keys, their gradients) from each row's residuals (see ``protocol.RESIDUALS``)."""
    dim = shard.spec.dim
    uniq, pos = kkeys.dedup_keys(keys)
    grads = np.empty((uniq.shape[0], dim), dtype=np.float32)
    if dim == 1:
        kmodels.lr_residual_grads(pos, values, row_ids, residuals[:, 0], grads[:, 0])
    else:
        params = np.empty((uniq.shape[0], dim), dtype=np.float32)
        shard.pull(uniq, params)
        kmodels.fm_residual_grads(pos, values, row_ids, params[:, 1:], residuals, grads[:, 0], grads[:, 1:])
    return uniq, grads


# (out_width, in_width and per_key describe a CALL's shapes; these two take theirs from their
# requests: a value per nonzero in, a row of partial sums per batch row out, summed over servers)
register_server_function(MARGINS_FUNCTION, partial_margins, out_width=1, in_width=1, per_key=False, replace=True)
register_server_function(RESIDUALS_FUNCTION, residual_grads, out_width=1, in_width=1, per_key=False, replace=True)
