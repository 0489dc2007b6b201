"""A trained model in one HDF5 file, for serving without parameter servers.

Schema (``format = "hpcps-model"``, ``version = 2``):

* attributes: ``model`` (lr | fm | wdl | deepfm), ``loss``, ``config`` (the training config,
  JSON), ``tables`` (the table names, JSON list, the first being the main one), ``fields``;
* one group per table, ``tables/<name>``, with attributes ``dim``, ``init``, ``init_scale``,
  ``seed`` (a key absent from the file has the table's initial value) and the datasets ``keys``
  (uint64, sorted ascending) and ``values`` (float32 ``(n, dim)``, each key's parameters, no
  optimizer state). A dense table (the deep models' MLP) is stored as its chunks: keys 0, 1, ...
  of ``dim`` floats each.

Version 1 files (one table: ``keys``, ``values`` and its attributes at the root) are still read.
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
VERSION = 2
TABLE_ATTRS = ("dim", "init", "init_scale", "seed")


def write(path: str, keys, values=None, attrs: dict | None = None) -> None:
    """Write atomically (to ``path.tmp``, then rename). Either one table, ``write(path, keys,
    values, attrs)`` with ``attrs`` holding the model's and the table's attributes (it is named
    after ``attrs["model"]``'s main table), or several: ``write(path, [(name, keys, values,
    table_attrs), ...], attrs=model_attrs)``."""
    attrs = dict(attrs or {})
    if values is not None:
        table = {k: attrs.pop(k) for k in TABLE_ATTRS if k in attrs}
        keys = [(MAIN_TABLE.get(attrs.get("model"), "w"), keys, values, table)]
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        for k, v in attrs.items():
            f.attrs[k] = v
        f.attrs["tables"] = json.dumps([t[0] for t in keys])
        for name, k, v, table_attrs in keys:
            sk, order = kkeys.radix_argsort(np.ascontiguousarray(k, dtype=np.uint64))
            g = f.create_group(f"tables/{name}")
            for a, x in table_attrs.items():
                g.attrs[a] = x
            g.create_dataset("keys", data=sk)
            g.create_dataset("values", data=kkeys.gather_rows(np.ascontiguousarray(v), order))
    fsync_path(tmp)
    os.replace(tmp, path)


MAIN_TABLE = {"lr": "w", "fm": "fm", "wdl": "wide", "deepfm": "fm"}


def export_from_servers(ctx, table_names, path: str, attrs: dict) -> None:
    """Collective over the servers: gather the tables' (keys, parameters) and write the file."""
    names = [table_names] if isinstance(table_names, str) else list(table_names)
    comm = ctx.servers_comm
    t = ctx.stall_timeout_s
    tables = []
    for name in names:
        table = ctx.server.tables[[s.name for s in ctx.specs].index(name)]
        table.check_finite("model")
        keys, rows = table.items()
        dim = table.spec.dim
        counts = transport.allgather_int(comm, keys.shape[0], t, f"gather of table {name!r}'s size")
        all_keys = transport.gatherv(comm, np.ascontiguousarray(keys), counts, 0, t, f"gather of table {name!r}'s keys")
        all_vals = transport.gatherv(comm, np.ascontiguousarray(rows[:, :dim]).reshape(-1), counts * dim, 0, t,
                                     f"gather of table {name!r}'s values")
        spec = table.spec
        if comm.Get_rank() == 0:
            tables.append((name, all_keys, all_vals.reshape(-1, dim),
                           {"dim": dim, "init": spec.init, "init_scale": spec.init_scale, "seed": spec.seed}))
    if comm.Get_rank() == 0:
        write(path, tables, attrs=attrs)


class ServingTable:
    """One table of a model file: its keys, their parameters, and the initializer of the others."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, attrs: dict):
        if values.ndim != 2 or values.shape[0] != keys.shape[0]:
            raise ValueError("keys and values differ in length")
        self.keys, self.values, self.attrs = keys, values, attrs
        self.dim = int(attrs["dim"])
        self.index = KeyIndex.from_keys(keys)

    def pull(self, keys: np.ndarray) -> np.ndarray:
        slots = self.index.lookup(keys)
        out = np.empty((keys.shape[0], self.dim), dtype=np.float32)
        kinit.pull_rows(self.values, slots, keys, self.dim, kinit.KINDS[self.attrs["init"]],
                        float(self.attrs["init_scale"]), int(self.attrs["seed"]), out)
        return out


class ServingModel:
    """A model file loaded for lookups (no MPI). ``tables`` by name; ``keys``, ``values`` and
    :meth:`pull` are the main (first) table's."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file {path} not found")
        try:
            f = h5py.File(path, "r")
        except OSError:
            raise ValueError(f"{path} is not an hpcps model file (not an HDF5 file); write one with "
                             f"train.model_out or hpcps export") from None
        self.tables: dict[str, ServingTable] = {}
        with f:
            if f.attrs.get("format") != FORMAT:
                raise ValueError(f"{path} is not an hpcps model file (format {f.attrs.get('format')!r}, "
                                 f"expected {FORMAT!r})")
            try:
                self.attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
                if "tables" in self.attrs:  # version 2
                    for name in json.loads(self.attrs["tables"]):
                        g = f[f"tables/{name}"]
                        t_attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in g.attrs.items()}
                        self.tables[name] = ServingTable(g["keys"][:], g["values"][:], t_attrs)
                else:  # version 1: one table at the root
                    self.tables[MAIN_TABLE.get(self.attrs.get("model"), "w")] = ServingTable(
                        f["keys"][:], f["values"][:], self.attrs)
            except (KeyError, OSError, ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: damaged hpcps model file ({e})") from None
        self.kind = self.attrs["model"]
        self.loss = self.attrs.get("loss", "logistic")
        self.main = next(iter(self.tables.values()))
        self.keys, self.values, self.dim = self.main.keys, self.main.values, self.main.dim

    @property
    def config(self) -> dict:
        return json.loads(self.attrs.get("config", "{}"))

    def pull(self, keys: np.ndarray) -> np.ndarray:
        return self.main.pull(keys)

    def dense(self, name: str, size: int) -> np.ndarray:
        """A dense table's vector of ``size`` (its chunks in order)."""
        t = self.tables[name]
        chunks = -(-size // t.dim)
        return t.pull(np.arange(chunks, dtype=np.uint64)).reshape(-1)[:size].copy()
