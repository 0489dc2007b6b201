"""A trained model in one HDF5 file, for serving without parameter servers.

Schema (``format = "hpcps-model"``, ``version = 1``):

* attributes: ``model`` (lr | fm), ``loss``, ``dim``, ``init``, ``init_scale``, ``seed`` (a key
  absent from the file has the table's initial value), ``config`` (the training config, JSON);
* ``keys``: uint64, sorted ascending; ``values``: float32 ``(n, dim)``, the parameters of each key
  (no optimizer state).

Written by the servers at the end of training (``train.model_out``): they gather their parts on
the first server, which writes the file. A model must fit in one process to be served this way.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

from hpcps import transport
from hpcps.checkpoint import fsync_path
from hpcps_kernels import init as kinit
from hpcps_kernels import keys as kkeys
from hpcps_kernels.hashtable import KeyIndex

FORMAT = "hpcps-model"
VERSION = 1


def write(path: str, keys: np.ndarray, values: np.ndarray, attrs: dict) -> None:
    """Write atomically: to ``path.tmp``, then rename."""
    sk, order = kkeys.radix_argsort(np.ascontiguousarray(keys, dtype=np.uint64))
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        for k, v in attrs.items():
            f.attrs[k] = v
        f.create_dataset("keys", data=sk)
        f.create_dataset("values", data=kkeys.gather_rows(np.ascontiguousarray(values), order))
    fsync_path(tmp)
    os.replace(tmp, path)


def export_from_servers(ctx, table_name: str, path: str, attrs: dict) -> None:
    """Collective over the servers: gather one table's (keys, parameters) and write the file."""
    table = ctx.server.tables[[s.name for s in ctx.specs].index(table_name)]
    keys, rows = table.items()
    dim = table.spec.dim
    comm = ctx.servers_comm
    t = ctx.stall_timeout_s
    counts = transport.allgather_int(comm, keys.shape[0], t, "gather of model sizes")
    all_keys = transport.gatherv(comm, np.ascontiguousarray(keys), counts, 0, t, "gather of model keys")
    all_vals = transport.gatherv(comm, np.ascontiguousarray(rows[:, :dim]).reshape(-1), counts * dim, 0, t,
                                 "gather of model values")
    if comm.Get_rank() == 0:
        spec = table.spec
        write(path, all_keys, all_vals.reshape(-1, dim),
              {**attrs, "dim": dim, "init": spec.init, "init_scale": spec.init_scale, "seed": spec.seed})


class ServingModel:
    """A model file loaded for lookups (no MPI)."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file {path} not found")
        try:
            f = h5py.File(path, "r")
        except OSError:
            raise ValueError(f"{path} is not an hpcps model file (not an HDF5 file); write one with "
                             f"train.model_out or hpcps export") from None
        with f:
            if f.attrs.get("format") != FORMAT:
                raise ValueError(f"{path} is not an hpcps model file (format {f.attrs.get('format')!r}, "
                                 f"expected {FORMAT!r})")
            try:
                self.attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
                self.keys = f["keys"][:]
                self.values = f["values"][:]
            except (KeyError, OSError) as e:
                raise ValueError(f"{path}: damaged hpcps model file ({e})") from None
        if self.values.ndim != 2 or self.values.shape[0] != self.keys.shape[0]:
            raise ValueError(f"{path}: damaged hpcps model file (keys and values differ in length)")
        self.kind = self.attrs["model"]
        self.loss = self.attrs.get("loss", "logistic")
        self.dim = int(self.attrs["dim"])
        self.index = KeyIndex.from_keys(self.keys)

    @property
    def config(self) -> dict:
        return json.loads(self.attrs.get("config", "{}"))

    def pull(self, keys: np.ndarray) -> np.ndarray:
        slots = self.index.lookup(keys)
        out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        kinit.pull_rows(self.values, slots, keys, self.dim, kinit.KINDS[self.attrs["init"]],
                        float(self.attrs["init_scale"]), int(self.attrs["seed"]), out)
        return out
