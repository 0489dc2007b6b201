"""The batches of a worker's training steps: :class:`BatchFeed`.

Step ``i`` (counted from the start of training) trains on batch ``i % steps`` of an epoch. Each
batch object is made once, in order, from one pass over the worker's part per epoch; a step is
given the next batches too, which its pipeline pulls and prepares ahead
(:class:`hpcps.train.pipeline.StepPipeline`), so a batch is made before its step and dropped
after it.

With more than one epoch over a part kept in memory, the batches are kept for the next epochs,
compacted (:meth:`hpcps.train.data.Dataset.compact`: their unique keys and int32 positions,
deduplicated once) when a step needs nothing else of the keys; once every step's batch is kept
the stream's parsed slices go. Not for the computation on the servers (it sends the keys).

``train.holdout = N``: every Nth row of the part never trains. A batch is split once: its
training rows are trained on (and kept), its held-out rows collected over the first whole epoch
into the holdout set (:meth:`BatchFeed.holdout_set`), which early stopping watches.
"""

from __future__ import annotations

from hpcps.train import data as tdata


class BatchFeed:
    """The batches of a worker's steps over its part ``train`` (a
    :class:`~hpcps.train.data.PartStream` or :class:`~hpcps.train.data.LoadedPart`), ``steps``
    steps an epoch for ``epochs`` epochs. ``holdout_phase``: the rows ``r % train.holdout ==
    holdout_phase % train.holdout`` are held out. ``end_job_with(line, code)``: ends the job on
    a bad line met mid-training (this worker alone knows of it)."""

    def __init__(self, cfg, train, steps: int, holdout_phase: int, keys_needed: bool, end_job_with):
        tr = cfg.train
        self.train = train
        self.batch_size = tr.batch_size
        self.holdout_every, self.holdout_phase = tr.holdout, holdout_phase
        self.steps = steps
        self.last_index = tr.epochs * steps  # (the index of the step after the last)
        self.end_job_with = end_job_with
        self.by_step: dict[int, tdata.Dataset] = {}  # the batches made for the steps not yet trained
        self.reading, self.next_in_pass = None, -1  # the current pass's batches, and the next one's index
        # the batches kept for the next epochs, by step of an epoch: (training rows, held-out rows)
        self.for_next_epochs: dict[int, tuple] | None = (
            {} if tr.epochs > 1 and isinstance(train, tdata.PartStream) and train.keep
            and cfg.model.compute == "workers" and not keys_needed else None)
        if self.for_next_epochs is not None or (tr.epochs == 1 and isinstance(train, tdata.PartStream)):
            train.keep_no_slices()  # (one pass: nothing reads a slice twice)
        self.held_out: dict[int, tdata.Dataset] = {}  # the held-out rows of the batches made
        self.collecting = False  # this epoch's held-out rows make the holdout set
        self.holdout_pieces: list[tdata.Dataset] = []

    def batch_at(self, i: int) -> tdata.Dataset:
        """The batch of the ``i``-th step since the start of training (made once, in order)."""
        if i not in self.by_step:
            j = i % self.steps
            got = self.for_next_epochs.get(j) if self.for_next_epochs is not None else None
            if got is not None:
                b, held = got[0].for_a_step(), got[1]
            else:
                b, held = self._from_pass(j), None
                if self.holdout_every:
                    b, held = b.split_every(self.holdout_every, j * self.batch_size, self.holdout_phase)
                if self.for_next_epochs is not None:
                    self._keep(j, b, held)
            if held is not None:
                self.held_out[i] = held
            self.by_step[i] = b
        return self.by_step[i]

    def _keep(self, j: int, b: tdata.Dataset, held) -> None:
        b.keep_prepared = True
        self.for_next_epochs[j] = (b, held)
        if len(self.for_next_epochs) == self.steps:  # every batch kept: the stream's slices go
            self._close_pass()
            try:
                self.train.forget()
            except tdata.DataError as e:
                self.end_job_with(f"error: {e}", 2)

    def _from_pass(self, j: int) -> tdata.Dataset:
        """Batch ``j`` of an epoch from a pass over the part: the current pass when it is at
        batch ``j``, else a new one from there (a new epoch starts again at batch 0)."""
        if self.next_in_pass != j:
            self._close_pass()
            self.reading = self.train.batches(self.batch_size, j)
        self.next_in_pass = j + 1
        try:
            return next(self.reading)
        except tdata.DataError as e:  # a bad line past the first block: this rank stops the job
            self.end_job_with(f"error: {e}", 2)

    def _close_pass(self) -> None:
        if self.reading is not None:
            self.reading.close()
        self.reading, self.next_in_pass = None, -1

    def start_epoch(self, collect_holdout: bool) -> None:
        """An epoch begins (its held-out rows make the holdout set when ``collect_holdout``);
        the part must still be the file the job opened."""
        self.collecting = collect_holdout
        try:  # (a stream checks at each read too; a part in memory reads nothing)
            self.train.check_unchanged()
        except tdata.DataError as e:
            self.end_job_with(f"error: {e}", 2)

    def take(self, i: int) -> tdata.Dataset:
        """The batch of step ``i``, now trained on (the previous one's is dropped)."""
        batch = self.batch_at(i)
        done = self.by_step.pop(i - 1, None)
        kept = self.for_next_epochs.get((i - 1) % self.steps) if self.for_next_epochs is not None else None
        if kept is not None and kept[0] is done and done.compacted is not None and \
                all(b is not done for b in self.by_step.values()):  # (not a step prepared ahead: few steps an epoch)
            done.narrow_rows()  # (trained on: kept with its rows' lengths, not offsets, till its next epoch)
        held = self.held_out.pop(i, None)
        if self.collecting and held is not None and held.rows:
            self.holdout_pieces.append(held)
        return batch

    def upcoming(self, i: int, pulls_ahead: bool) -> list:
        """The batches after step ``i``'s that its pipeline prepares ahead: two (three when it
        pulls two ahead), fewer at the end of training."""
        return [self.batch_at(j) for j in range(i + 1, min(i + 3 + pulls_ahead, self.last_index))]

    def holdout_set(self) -> tdata.Dataset:
        """The held-out rows collected this epoch, as one Dataset (the kept batches' held-out
        rows are dropped: they are in it now)."""
        holdout = tdata.concatenate(self.holdout_pieces)
        self.holdout_pieces, self.collecting = [], False
        if self.for_next_epochs is not None:
            self.for_next_epochs = {j: (b, None) for j, (b, _) in self.for_next_epochs.items()}
        return holdout

    def kept_batches_mb(self) -> float | None:
        """The memory of the batches kept across epochs, compacted (MiB; None when none are)."""
        if self.for_next_epochs is None:
            return None
        kept = self.for_next_epochs.values()
        return round(sum(b.nbytes + (h.nbytes if h is not None else 0) for b, h in kept) / 2**20, 1)
