"""Parquet and CSV with a header (pyarrow): the same rows give the model of the libsvm file
written by the documented rule (a float column c: key c with its value; any other column:
xxh64(str(value), seed=c) masked to the hash bits, value 1; nulls left out), bit for bit."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import xxhash  # noqa: E402

from hpcps.train import data  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_faults import job, sets  # noqa: E402
from test_inputs import assert_same_model, train  # noqa: E402

BITS = 18
ROWS = 3_000


def table(seed: int = 3) -> "pa.Table":
    """Avazu-like rows: a 0/1 label, a weight, two float columns (with nulls), a string and an integer id."""
    rng = np.random.default_rng(seed)
    f0 = rng.normal(size=ROWS).astype(np.float32)
    f1 = rng.uniform(size=ROWS).astype(np.float32)
    site = rng.choice(["a1f", "b22", "c3", "dd9", "e"], ROWS)
    c1 = rng.integers(1000, 1010, ROWS)
    margin = f0 + (site == "b22") - 0.5 * (c1 % 3 == 0)
    label = (rng.uniform(size=ROWS) < 1 / (1 + np.exp(-margin))).astype(np.int64)
    return pa.table({"click": label, "f0": pa.array(f0, mask=rng.uniform(size=ROWS) < 0.1),
                     "site": pa.array(site, mask=rng.uniform(size=ROWS) < 0.05), "f1": f1, "C1": c1,
                     "w": rng.choice([0.5, 1.0, 2.0], ROWS)})


def libsvm_lines(t, features: list[str], label: str = "click", fielded: bool = False) -> list[bytes]:
    """The libsvm lines of the rule (keys computed with the xxHash C library, not hpcps's);
    ``fielded``: libffm lines, a feature's field its column's position among ``features``."""
    names, mask = t.column_names, (1 << BITS) - 1
    cols = {n: t.column(n).to_pylist() for n in features}
    out = []
    for r, y in enumerate(t.column(label).to_pylist()):
        fields = []
        for field, n in enumerate(features):
            c, v = names.index(n), cols[n][r]
            if v is None:
                continue
            head = f"{field}:" if fielded else ""
            if pa.types.is_floating(t.column(n).type):
                fields.append(f"{head}{c}:{float(np.float32(v))!r}")
            else:
                fields.append(f"{head}{xxhash.xxh64_intdigest(str(v).encode(), seed=c) & mask}:1")
        out.append((" ".join([str(y), *fields]) + "\n").encode())
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("parquet")
    t = table()
    everything = ["f0", "site", "f1", "C1"]
    out = {"dir": d, "table": t}
    out["svm"] = str(d / "rows.svm")
    lines = libsvm_lines(t, everything)
    open(out["svm"], "wb").writelines(lines)
    out["parquet"] = str(d / "rows.parquet")
    pq.write_table(t.drop(["w"]), out["parquet"], row_group_size=700)
    out["csv"] = str(d / "rows.csv")
    pcsv.write_csv(t.drop(["w"]), out["csv"])
    for kind in ("parts", "svm_parts", "pq4", "svm_halves"):
        os.makedirs(d / kind)
    for i in range(3):
        pq.write_table(t.drop(["w"]).slice(i * 1000, 1000), str(d / "parts" / f"part-{i:05d}.parquet"))
    (d / "parts" / "_SUCCESS").touch()
    for i in range(4):
        pq.write_table(t.drop(["w"]).slice(i * 750, 750), str(d / "pq4" / f"part-{i:05d}.parquet"))
        open(d / "svm_parts" / f"part-{i:05d}", "wb").writelines(lines[i * 750:(i + 1) * 750])
    for i in range(2):
        open(d / "svm_halves" / f"part-{i:05d}", "wb").writelines(lines[i * 1500:(i + 1) * 1500])
    return out


def fit(spec, tmp, name, n=0, **kv):
    return train(spec, tmp, name, n, data__hash_bits=BITS, data__label_column="click", **kv)


def test_a_float_column_is_its_index_and_a_categorical_one_is_hashed_per_column(files):
    ds = data.load_part(files["parquet"], 0, 1, "auto", BITS, columns=data.tables.Columns("click"))
    ref = data.load_part(files["svm"], 0, 1, "libsvm", BITS)
    for a in ("labels", "indptr", "indices", "values"):
        np.testing.assert_array_equal(getattr(ds, a), getattr(ref, a))
    assert data.detect_format(files["csv"], "auto") == "csv" and data.detect_format(files["parquet"], "auto") == "parquet"
    # the automatic batch size counts a table's rows (not a Parquet file's newline bytes, a CSV's header)
    for spec in (files["parquet"], files["csv"], str(files["dir"] / "parts")):
        assert data.rows_at_least(spec, 10**6) == ROWS


def test_parquet_a_directory_of_parts_and_csv_give_the_libsvm_files_model(files, tmp_path):
    reference = fit(files["svm"], tmp_path, "svm")
    for name, spec in (("parquet", files["parquet"]), ("parts", str(files["dir"] / "parts")), ("csv", files["csv"])):
        assert_same_model(fit(spec, tmp_path, name), reference)


@pytest.mark.mpi
def test_two_workers_reading_whole_parquet_parts_or_row_ranges_make_the_libsvm_parts_model(files, tmp_path):
    """mpiexec -n 3: 1 server and 2 workers, each reading 2 whole part files of either kind; and
    one Parquet file cut in 2 row ranges, the rows of 2 libsvm files of half the rows each."""
    reference = fit(str(files["dir"] / "svm_parts"), tmp_path, "svm", 3)
    assert_same_model(fit(str(files["dir"] / "pq4"), tmp_path, "pq", 3), reference)
    halves = fit(str(files["dir"] / "svm_halves"), tmp_path, "svm-halves", 3)
    assert_same_model(fit(files["parquet"], tmp_path, "pq-rows", 3), halves)


def test_named_feature_columns_and_a_weight_column(files, tmp_path):
    d = files["dir"]
    svm = str(d / "some.svm")
    open(svm, "wb").writelines(libsvm_lines(files["table"], ["site", "f1"]))
    reference = fit(svm, tmp_path, "some-svm")
    assert_same_model(fit(files["parquet"], tmp_path, "some", data__feature_columns="site, f1"), reference)
    weighted = str(d / "weighted.parquet")
    pq.write_table(files["table"], weighted)
    csv = str(d / "weighted.csv")
    pcsv.write_csv(files["table"], csv)
    a = fit(weighted, tmp_path, "w-pq", data__weight_column="w", data__feature_columns="site,f1")
    assert_same_model(fit(csv, tmp_path, "w-csv", data__weight_column="w", data__feature_columns="site,f1"), a)
    assert not np.array_equal(a.values, reference.values)  # (the weights count)


def test_a_missing_column_is_named(files, tmp_path):
    rc, out = job(0, ["train", *sets(data__train=files["parquet"], data__feature_columns="site,nope",
                                     data__label_column="click", train__progress=False)], timeout=120)
    assert rc == 2 and "no column 'nope'" in out and files["parquet"] in out, out[-2000:]
    rc, out = job(0, ["train", *sets(data__train=files["csv"], train__progress=False)], timeout=120)
    assert rc == 2 and "no column 'label'" in out, out[-2000:]


def test_test_and_predict_files_in_parquet_score_as_libsvm(files, tmp_path):
    outs = {}
    for name, spec in (("svm", files["svm"]), ("pq", files["parquet"])):
        pred = str(tmp_path / f"{name}.pred")
        model = fit(spec, tmp_path, name, data__test=spec, data__predict=spec, data__predict_out=pred,
                    train__metrics=str(tmp_path / f"{name}.jsonl"))
        outs[name] = (model, open(pred).read(), open(tmp_path / f"{name}.jsonl").read())
    assert_same_model(outs["pq"][0], outs["svm"][0])
    assert outs["pq"][1] == outs["svm"][1] and outs["pq"][1].count("\n") == ROWS
    assert [ln.split('"time')[0] for ln in outs["pq"][2].splitlines() if "auc" in ln] == \
        [ln.split('"time')[0] for ln in outs["svm"][2].splitlines() if "auc" in ln]
    # hpcps predict, eval and load_model read Parquet too, with the columns the training named
    # (data.label_column = "click": no feature, though the model file's rows have it)
    model, scores = str(tmp_path / "pq.h5"), tmp_path / "scores.txt"
    rc, out = job(0, ["predict", "--model", model, "--data", files["parquet"], "--out", str(scores)])
    assert rc == 0, out[-2000:]
    expected = np.loadtxt(tmp_path / "pq.pred")
    assert np.abs(np.loadtxt(scores) - expected).max() <= 5e-7
    import hpcps

    assert np.abs(hpcps.load_model(model).predict_proba(files["csv"])[:, 1] - expected).max() <= 5e-7
    rc, out = job(0, ["eval", "--model", model, "--data", files["parquet"]])
    assert rc == 0 and '"auc"' in out, out[-2000:]


def test_without_pyarrow_loading_says_what_to_install(files, tmp_path):
    """A package named pyarrow that fails to import comes first on the job's path, as without the extra."""
    import subprocess

    hide = tmp_path / "without-pyarrow" / "pyarrow"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('the parquet extra, left out')\n")
    proc = subprocess.run([sys.executable, "-m", "hpcps.cli", "train", *sets(data__train=files["parquet"],
                                                                             train__progress=False)],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(hide.parent)))
    assert proc.returncode == 2 and "pip install 'hpcps[parquet]'" in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_ffm_on_parquet_reads_each_feature_column_as_its_field(files, tmp_path):
    """The libffm file of the rule, field = the column's position among the feature columns."""
    ffm = str(tmp_path / "rows.ffm")
    open(ffm, "wb").writelines(libsvm_lines(files["table"], ["f0", "site", "f1", "C1"], fielded=True))
    kv = {"model__type": "ffm", "model__fields": 4, "train__epochs": 1}
    assert_same_model(fit(files["parquet"], tmp_path, "ffm-pq", **kv), fit(ffm, tmp_path, "ffm-ffm", **kv))


@pytest.mark.mpi
def test_a_parquet_file_in_row_ranges_resumes_exactly(files, tmp_path):
    """mpiexec -n 3, one Parquet file cut in 2 row ranges: stopped mid-epoch after a checkpoint,
    resumed, it ends with the model of the run never stopped, bit for bit."""
    from hpcps.ps import checkpoint
    from test_faults import start
    from test_inputs import stopped_after_checkpoint

    common = dict(train__batch_size=20, train__epochs=2, train__progress=False, cluster__servers=1,
                  cluster__staleness=0, checkpoint__every_steps=20)
    reference = fit(files["parquet"], tmp_path, "reference", 3, checkpoint__dir=str(tmp_path / "ck-ref"), **common)
    ck = tmp_path / "ck"
    proc = start(3, ["train", *sets(train__model_out=str(tmp_path / "never.h5"), checkpoint__dir=str(ck),
                                    data__train=files["parquet"], data__hash_bits=BITS, data__label_column="click",
                                    **common)])
    rc, out = stopped_after_checkpoint(proc, str(ck), 20)
    assert rc == 75, out[-3000:]
    newest, manifest = checkpoint.newest_good(str(ck))
    assert manifest["position"]["epoch"] == 1 and manifest["position"]["step"] < 1500 // 20, manifest["position"]
    assert manifest["data"]["workers"] == 2, manifest["data"]
    resumed = fit(files["parquet"], tmp_path, "resumed", 3, said=f"resuming from {newest}", checkpoint__dir=str(ck),
                  checkpoint__resume="auto", **common)
    assert_same_model(resumed, reference)


def test_an_infinite_value_or_a_list_column_is_named_with_its_row(tmp_path):
    """An inf in a float feature column (Parquet or CSV) is its column and its row in the file, not a
    NaN loss at run time; a list column is one line, not pyarrow's error."""
    inf = np.zeros(300)
    inf[250] = np.inf
    t = pa.table({"label": np.ones(300), "f": inf})
    pq.write_table(t, tmp_path / "inf.parquet", row_group_size=100)
    pcsv.write_csv(t, tmp_path / "inf.csv")
    for name in ("inf.parquet", "inf.csv"):
        assert data.load_part(str(tmp_path / name), 0, 2).rows == 150  # rows 1-150 are finite
        with pytest.raises(data.DataError, match=rf"{name}: column 'f', row 251: value is infinite"):
            data.load_part(str(tmp_path / name), 1, 2)  # (its rows start at the file's 151st)
    pq.write_table(pa.table({"label": [1.0], "f": [[1, 2]]}), tmp_path / "list.parquet")
    with pytest.raises(data.DataError, match=r"list.parquet: column 'f' holds list<.*feature_columns"):
        data.load_part(str(tmp_path / "list.parquet"), 0, 1)
