"""The flush of the significance filter's residuals in a training run (``filters.push_threshold``,
:mod:`hpcps.ps.filters`): at the end of every epoch and before every checkpoint, every worker pushes
what its residuals hold and ends the iteration (``Context.flush_filters``), so that the epoch's
evaluation, early stopping's snapshot, a checkpoint and the exported model hold every update.

Rows a worker pulled before a flush for its next steps lack what it pushed: they are dropped and
pulled again, as a run resumed from a checkpoint taken there pulls them (the MLP of a deep model
too). So under BSP a run resumed from a checkpoint is bit-identical to one never stopped, as
without the filter. What the flush costs (its pushes, the MLP pulled again, each dropped batch's
rows pulled again) is taken back from ``push_threshold_saved_bytes``
(:func:`hpcps.ps.filters.charged`), which is thus exactly the traffic the filter saved. Under
backup workers the first worker's periodic checkpoints (:mod:`hpcps.train.quorum_checkpoints`)
are written without a flush (the other workers take no part in them): a restart from one loses
what the residuals held then, less than the threshold per coordinate of each key and worker.
"""

from __future__ import annotations

from hpcps.ps import filters


def flush_filters(ctx, pipeline) -> None:
    """Workers, every one at the same point, after ``pipeline.finish()`` (collective over a worker
    group for the deep models): the residuals pushed, the MLP pulled again, and the rows pulled
    ahead dropped (their batches, kept with what was prepared for them, marked in
    ``pipeline.refetch``, whose next pull :func:`refetch` charges)."""
    if not ctx.flush_filters():
        return
    filters.charged(ctx.stats, pipeline.finish)
    pipeline.refetch = {id(p.batch) for p in pipeline.ahead if p.params is not None}
    for p in pipeline.ahead:
        p.params = None


def refetch(ctx, pipeline, batch, pull):
    """``pull()`` (a batch's rows pulled now), charged to the flush when the flush dropped them."""
    if id(batch) not in pipeline.refetch:
        return pull()
    pipeline.refetch.discard(id(batch))
    return filters.charged(ctx.stats, pull)
