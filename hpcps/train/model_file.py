"""A trained model in one HDF5 file, for serving without parameter servers.

Schema (``format = "hpcps-model"``, ``version = 3``):

* attributes: ``model`` (lr | fm | ffm | wdl | deepfm), ``loss``, ``config`` (the training config,
  JSON), ``tables`` (the table names, JSON list, the first being the main one), ``fields``;
  what its keys mean (:func:`trained_on`): ``hash_bits``, ``input_format`` (libsvm | criteo |
  vw | libffm, as the training file was read) and ``key_hashing`` (how that format makes keys);
  ``xxh64``, the checksum of every other attribute and every array (:func:`digest`);
* one group per table, ``tables/<name>``, with attributes ``dim``, ``init``, ``init_scale``,
  ``seed`` (a key absent from the file has the table's initial value) and the datasets ``keys``
  (uint64, sorted ascending) and ``values`` (float32 ``(n, dim)``, each key's parameters, no
  optimizer state). A dense table (the deep models' MLP) is stored as its chunks: keys 0, 1, ...
  of ``dim`` floats each.

Files written before version 3 (no checksum, no ``hash_bits`` or ``input_format``) are still read:
their hash bits and format are taken from their ``config`` where it names them (a format of
"auto" is not known), and their arrays cannot be checked. Version 1 files (one table: ``keys``,
``values`` and its attributes at the root) are read too. Written by the servers at the end of
training (``train.model_out``): they gather their parts on the first server, which writes the
file. A model must fit in one process to be served this way.
"""

from __future__ import annotations

import json
import os

import numpy as np

from hpcps import outputs
from hpcps_kernels import init as kinit
from hpcps_kernels import keys as kkeys
from hpcps_kernels.hashing import xxh64, xxh64_words
from hpcps_kernels.hashtable import KeyIndex

FORMAT = "hpcps-model"
VERSION = 3
TABLE_ATTRS = ("dim", "init", "init_scale", "seed")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# how each input format turns a row's features into keys: a model's keys mean nothing to data
# whose format makes them another way
KEY_HASHING = {"libsvm": "the feature indices as written, masked to the hash bits",
               "criteo": "XXH64 of each column's token, seeded by its column, masked to the hash bits",
               "vw": "XXH64 of each feature name, seeded by its namespace, masked to the hash bits",
               "libffm": "each feature's field above the hash bits, its index below",
               "parquet": "a float column's index; XXH64 of any other column's str(value), seeded by its index",
               "csv": "a float column's index; XXH64 of any other column's str(value), seeded by its index"}


class ModelFileError(ValueError):
    """A file that cannot be served as a model: ``exit_status`` 2 when it is not an hpcps model file
    (the user gave the wrong file), 1 when it is one but damaged."""

    def __init__(self, message: str, status: int, reason: str = ""):
        super().__init__(message)
        self.exit_status, self.reason = status, reason


def trained_on(input_format: str, hash_bits: int) -> dict:
    """The attributes that say what a model's keys mean: its hash bits and the training file's
    format (``""`` when unknown) and key hashing."""
    return {"hash_bits": int(hash_bits), "input_format": input_format,
            "key_hashing": KEY_HASHING.get(input_format, "")}


def _plain(v):
    """An HDF5 attribute's value as a plain Python value."""
    v = v.item() if hasattr(v, "item") else v
    return v.decode() if isinstance(v, bytes) else v


def _arrays_xxh64(h: np.uint64, *arrays: np.ndarray) -> np.uint64:
    for a in arrays:
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        whole = raw.shape[0] // 8 * 8
        h = np.uint64(xxh64_words(raw[:whole].view(np.uint64), raw[whole:], np.uint64(h)))
    return h


def digest(attrs: dict, tables: list[tuple[str, dict, np.ndarray, np.ndarray]]) -> str:
    """XXH64 (hex) of a model file's attributes (``attrs``, without ``xxh64``; each table's) and
    arrays (each table's keys and values, in order)."""
    meta = json.dumps({"attrs": {k: v for k, v in attrs.items() if k != "xxh64"},
                       "tables": [[name, t_attrs] for name, t_attrs, _, _ in tables]},
                      sort_keys=True, separators=(",", ":"), default=str).encode()
    raw = np.frombuffer(meta, dtype=np.uint8)
    h = np.uint64(xxh64(raw, 0, raw.shape[0], np.uint64(0)))
    for _, _, keys, values in tables:
        h = _arrays_xxh64(h, keys, values)
    return f"{int(h):016x}"


def write(path: str, keys, values=None, attrs: dict | None = None) -> None:
    """Write atomically (:func:`hpcps.outputs.replacing`: a temporary file beside ``path``, then
    renamed; removed on any failure, which raises an OutputError naming ``path``). Either one
    table, ``write(path, keys, values, attrs)`` with ``attrs`` holding the model's and the table's
    attributes (it is named after ``attrs["model"]``'s main table), or several: ``write(path,
    [(name, keys, values, table_attrs), ...], attrs=model_attrs)``."""
    attrs = dict(attrs or {})
    if values is not None:
        table = {k: attrs.pop(k) for k in TABLE_ATTRS if k in attrs}
        keys = [(MAIN_TABLE.get(attrs.get("model"), "w"), keys, values, table)]
    need = sum(np.asarray(k).nbytes + np.asarray(v).nbytes for _, k, v, _ in keys)
    outputs.write_h5(path, lambda f: _fill(f, keys, attrs), need + (64 << 10) + need // 100)  # (+ HDF5's metadata)


def _fill(f, tables: list, attrs: dict) -> None:  # (f: an h5py.File)
    f.attrs["format"] = FORMAT
    f.attrs["version"] = VERSION
    for k, v in attrs.items():
        f.attrs[k] = v
    f.attrs["tables"] = json.dumps([t[0] for t in tables])
    written = []
    for name, k, v, table_attrs in tables:
        sk, order = kkeys.radix_argsort(np.ascontiguousarray(k, dtype=np.uint64))
        sv = kkeys.gather_rows(np.ascontiguousarray(v), order)
        g = f.create_group(f"tables/{name}")
        for a, x in table_attrs.items():
            g.attrs[a] = x
        g.create_dataset("keys", data=sk)
        g.create_dataset("values", data=sv)
        written.append((name, {a: _plain(x) for a, x in g.attrs.items()}, sk, sv))
    f.attrs["xxh64"] = digest({a: _plain(x) for a, x in f.attrs.items()}, written)


MAIN_TABLE = {"lr": "w", "fm": "fm", "ffm": "ffm", "wdl": "wide", "deepfm": "fm"}

READABLE_FORMATS = ("text", "npz")


def write_readable(path: str, fmt: str, attrs: dict, tables: list) -> None:
    """A model's ``tables`` (``[(name, keys, values, table_attrs), ...]``) written for other
    tools, atomically: ``text`` (VW's readable model, xLearn's txt: ``#`` lines with the model's
    attributes and each table's, then ``key<TAB>value value ...`` by key, the keys in decimal and
    the values as float32 prints them, exactly) or ``npz`` (NumPy's archive: ``NAME.keys`` uint64
    and ``NAME.values`` float32 per table, ``attrs`` a JSON string)."""
    ordered = []
    for name, k, v, table_attrs in tables:
        sk, order = kkeys.radix_argsort(np.ascontiguousarray(k, dtype=np.uint64))
        ordered.append((name, sk, kkeys.gather_rows(np.ascontiguousarray(v, dtype=np.float32), order), table_attrs))
    plain = {a: _plain(x) for a, x in attrs.items() if a != "xxh64"}
    need = sum(sk.nbytes + sv.nbytes for _, sk, sv, _ in ordered)
    if fmt == "npz":
        arrays = {"attrs": np.array(json.dumps(plain))}
        for name, sk, sv, table_attrs in ordered:
            arrays[f"{name}.keys"], arrays[f"{name}.values"] = sk, sv
            arrays[f"{name}.attrs"] = np.array(json.dumps({a: _plain(x) for a, x in table_attrs.items()}))
        with outputs.replacing(path, need + (64 << 10)) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
        return
    if fmt != "text":
        raise ValueError(f"export format {fmt!r}: expected one of {READABLE_FORMATS}")
    with outputs.replacing(path, 4 * need + (64 << 10)) as tmp, open(tmp, "w") as f:
        f.write(f"# {FORMAT} model, readable: key<TAB>values, by key\n")
        for a in sorted(plain):
            f.write(f"# {a} = {json.dumps(plain[a])}\n")
        for name, sk, sv, table_attrs in ordered:
            width = sv.shape[1] if sv.ndim > 1 else 1
            f.write(f"# table {name}: {sk.shape[0]} keys x {width} values; "
                    f"{json.dumps({a: _plain(x) for a, x in table_attrs.items()})}\n")
            rows = sv.reshape(sk.shape[0], width).astype(str)  # (NumPy's shortest float32 repr: reads back exactly)
            for key, row in zip(sk.tolist(), rows.tolist()):
                f.write(f"{key}\t{' '.join(row)}\n")


def export_from_servers(ctx, table_names, path: str, attrs: dict) -> None:
    """Collective over the servers: gather the tables' (keys, parameters) and write the file."""
    names = [table_names] if isinstance(table_names, str) else list(table_names)
    servers = ctx.among_servers
    tables = []
    for name in names:
        table = ctx.server.tables[[s.name for s in ctx.specs].index(name)]
        table.check_finite("model")
        keys, rows = ctx.server.primary_items(table)  # (with replicas: each shard once)
        dim = table.spec.dim
        counts = servers.sizes(keys.shape[0], f"gather of table {name!r}'s size")
        all_keys = servers.gather_to_first(keys, counts, f"gather of table {name!r}'s keys")
        all_vals = servers.gather_to_first(np.ascontiguousarray(rows[:, :dim]).reshape(-1), counts * dim,
                                           f"gather of table {name!r}'s values")
        spec = table.spec
        if servers.is_first:
            tables.append((name, all_keys, all_vals.reshape(-1, dim),
                           {"dim": dim, "init": spec.init, "init_scale": spec.init_scale, "seed": spec.seed}))
    if servers.size < len(ctx.server.placement.live_servers):  # (under ULFM: one lost while gathering)
        raise outputs.OutputError(f"{path}: not written: a server was lost while the model was gathered from "
                                  f"the servers (its rows would be missing from it)")
    if servers.is_first:
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


def _damaged(path: str, why: str) -> ModelFileError:
    return ModelFileError(f"{path}: damaged hpcps model file ({why}); write it again (train.model_out or "
                          f"hpcps export)", 1)


def _not_a_model(path: str, what: str) -> ModelFileError:
    return ModelFileError(f"{path} is not an hpcps model file ({what}); write one with train.model_out or "
                          f"hpcps export CHECKPOINT --out MODEL.h5", 2, what)


def _read(path: str) -> tuple[dict, list[tuple[str, dict, np.ndarray, np.ndarray]]]:
    """The attributes and tables ``(name, attributes, keys, values)`` of the model file at
    ``path``; a ModelFileError when it is no model file (status 2) or a damaged one (1)."""
    import h5py  # (on first use: a training job that writes no model file never loads HDF5)

    if not os.path.exists(path):
        raise FileNotFoundError(f"model file {path} not found")
    if os.path.isdir(path):
        raise _not_a_model(path, "a checkpoint directory: hpcps export makes a model file of it"
                           if os.path.exists(os.path.join(path, "manifest.json")) else "a directory")
    if not os.path.isfile(path):
        raise _not_a_model(path, "not a regular file")
    with open(path, "rb") as fh:
        head = fh.read(len(HDF5_SIGNATURE))
    try:
        f = h5py.File(path, "r")
    except Exception as e:  # noqa: BLE001 - HDF5 fails in many ways on a file it cannot read
        if head != HDF5_SIGNATURE:
            raise _not_a_model(path, "not an HDF5 file") from None
        raise _damaged(path, f"HDF5 cannot open it: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    with f:
        try:
            fmt = _plain(f.attrs.get("format"))
        except Exception as e:  # noqa: BLE001
            raise _damaged(path, f"its attributes cannot be read: {e}") from None
        if fmt != FORMAT:
            what = ("a server file of a checkpoint: inspect or export its directory"
                    if fmt == "hpcps-checkpoint" else f"format {fmt!r}, expected {FORMAT!r}")
            raise _not_a_model(path, what)
        try:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            tables = []
            if "tables" in attrs:  # version 2 and later
                for name in json.loads(attrs["tables"]):
                    g = f[f"tables/{name}"]
                    tables.append((name, {k: _plain(v) for k, v in g.attrs.items()}, g["keys"][:], g["values"][:]))
            else:  # version 1: one table at the root
                tables.append((MAIN_TABLE.get(attrs.get("model"), "w"), attrs, f["keys"][:], f["values"][:]))
        except Exception as e:  # noqa: BLE001 - a damaged file may fail in any way inside HDF5
            raise _damaged(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if "xxh64" in attrs and digest(attrs, tables) != attrs["xxh64"]:
        raise _damaged(path, "it fails its XXH64 checksum")
    return attrs, tables


def other_keys(fmt: str, other: str) -> bool:
    """Whether rows read as ``other`` get their keys another way than rows read as ``fmt``."""
    return fmt != other and KEY_HASHING.get(fmt) != KEY_HASHING.get(other)


def scored_format_clash(train_fmt: str, key: str, path: str, fmt: str) -> str | None:
    """Why a model trained on ``train_fmt`` rows cannot be judged on (or score) the rows of
    ``path`` (configuration ``key``) read as ``fmt``, or None: their keys are made another way,
    so every test metric would be that of a model that knows none of them (``hpcps eval`` and
    ``predict`` refuse such data likewise)."""
    if not train_fmt or not other_keys(train_fmt, fmt):
        return None
    return (f"{key} = {path!r} is read as {fmt} (keys: {KEY_HASHING.get(fmt, fmt)}) but data.train as {train_fmt} "
            f"(keys: {KEY_HASHING.get(train_fmt, train_fmt)}): the model would know none of its keys. Give "
            f"{key} in {train_fmt} format, or set data.allow_other_hashing = true to score it anyway")


class ServingModel:
    """A model file loaded for lookups (no MPI), its checksum verified (files written before
    version 3 have none). ``tables`` by name; ``keys``, ``values`` and :meth:`pull` are the main
    (first) table's. Raises FileNotFoundError, or a ModelFileError that says whether the file is
    no model file or a damaged one."""

    def __init__(self, path: str):
        self.path = path
        self.attrs, tables = _read(path)
        self.checked = "xxh64" in self.attrs  # (written before version 3: no checksum to verify)
        self.tables: dict[str, ServingTable] = {}
        try:
            for name, t_attrs, keys, values in tables:
                self.tables[name] = ServingTable(keys, values, t_attrs)
            self.kind = self.attrs["model"]
        except (KeyError, ValueError) as e:
            raise _damaged(path, str(e)) from None
        self.loss = self.attrs.get("loss", "logistic")
        self.main = next(iter(self.tables.values()))
        self.keys, self.values, self.dim = self.main.keys, self.main.values, self.main.dim

    @property
    def config(self) -> dict:
        return json.loads(self.attrs.get("config", "{}"))

    @property
    def hash_bits(self) -> int | None:
        """The hash bits of its keys (a file before version 3: its config's), None if unknown."""
        bits = self.attrs.get("hash_bits", self.config.get("data", {}).get("hash_bits"))
        return int(bits) if bits is not None else None

    @property
    def input_format(self) -> str:
        """The format its training file was read as ("" when unknown: a file before version 3
        whose config said "auto")."""
        if "input_format" in self.attrs:
            return self.attrs["input_format"]
        fmt = self.config.get("data", {}).get("format", "auto")
        return "" if fmt == "auto" else fmt

    def mismatch(self, data: str, fmt: str, hash_bits: int) -> str | None:
        """Why rows of ``data`` read as ``fmt`` with ``hash_bits`` would be looked up under other keys
        than the model learned (other hash bits, another format's key hashing), or None."""
        how = "pass --allow-other-hashing to score them anyway"
        if self.hash_bits is not None and hash_bits != self.hash_bits:
            return (f"{self.path} was trained with {self.hash_bits} hash bits; with {hash_bits} the rows of {data} "
                    f"get other keys, unknown to the model. Leave out --hash-bits, or {how}")
        mine = self.input_format
        if mine and other_keys(mine, fmt):
            return (f"{self.path} was trained on {mine} rows (keys: {KEY_HASHING.get(mine, mine)}); {data} is read "
                    f"as {fmt} (keys: {KEY_HASHING.get(fmt, fmt)}), whose keys are unknown to the model. Give the "
                    f"rows in {mine} format, or {how}")
        return None

    def pull(self, keys: np.ndarray) -> np.ndarray:
        return self.main.pull(keys)

    def dense(self, name: str, size: int) -> np.ndarray:
        """A dense table's vector of ``size`` (its chunks in order)."""
        t = self.tables[name]
        chunks = -(-size // t.dim)
        return t.pull(np.arange(chunks, dtype=np.uint64)).reshape(-1)[:size].copy()
