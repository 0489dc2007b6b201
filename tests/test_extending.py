"""The extension points of docs/extending.md that live in hpcps.train: models and data formats
registered from user code (optimizers' registry is tested in test_kernels, server functions' in
test_ps; every extension point runs end to end in test_examples)."""

import numpy as np
import pytest

import hpcps
from hpcps import config
from hpcps.train import data as tdata
from hpcps.train import models
from hpcps_kernels.parse import ParseError


@pytest.fixture(autouse=True)
def registries(monkeypatch):
    """Each test registers into copies of the registries (and of the configuration's names)."""
    for key in (("model", "type"), ("data", "format")):
        monkeypatch.setitem(config.CHOICES, key, config.CHOICES[key])
    monkeypatch.setattr(models, "MODELS", dict(models.MODELS))
    monkeypatch.setattr(tdata, "TEXT_PARSERS", dict(tdata.TEXT_PARSERS))


class Hinge(hpcps.Model):
    def declare_tables(self, ctx, cfg):
        return ["w" + self.suffix]  # (a stand-in for a table: no context here)


def test_a_registered_model_is_a_model_type():
    assert hpcps.register_model("hinge", Hinge) is Hinge
    cfg = config.from_dict({"model": {"type": "hinge"}})
    model = models.make_model(None, cfg)
    assert isinstance(model, Hinge) and model.table == "w"
    assert cfg.optimizer.params == {}  # FTRL's default l2 of the factor models is not a registered model's


def test_an_unknown_model_type_names_the_key_and_the_registered_ones():
    hpcps.register_model("hinge", Hinge)
    with pytest.raises(config.ConfigError, match=r"model\.type = 'hinje': expected one of .*'hinge'"):
        config.from_dict({"model": {"type": "hinje"}})
    cfg = config.from_dict({"model": {"type": "hinge"}})
    del models.MODELS["hinge"]  # (a rank that did not register it)
    with pytest.raises(ValueError, match=r"model\.type = 'hinge' is not registered on this rank"):
        models.make_model(None, cfg)


def test_a_model_type_is_registered_once():
    hpcps.register_model("hinge", Hinge)
    with pytest.raises(ValueError, match="model type 'hinge' is already registered"):
        hpcps.register_model("hinge", Hinge)
    assert hpcps.register_model("hinge", Hinge, replace=True) is Hinge
    for name in ("lr", "fm", "wdl", "deepfm"):
        with pytest.raises(ValueError, match=f"model type '{name}' is already registered"):
            hpcps.register_model(name, Hinge, replace=True)
    with pytest.raises(TypeError, match="expected a subclass of hpcps.Model"):
        hpcps.register_model("other", object)


def test_a_registered_model_computes_on_the_workers():
    hpcps.register_model("hinge", Hinge)
    with pytest.raises(config.ConfigError, match=r"model\.compute = 'servers' is for lr and fm"):
        config.from_dict({"model": {"type": "hinge", "compute": "servers"}})


def parse_pipes(block, *, source, first_line, skip_bad, binary, seen, bias, bits):
    """``label|key key ...`` lines (a test's format, in plain Python)."""
    labels, indptr, indices = [], [0], []
    for i, line in enumerate(bytes(block).decode().splitlines()):
        label, _, keys = line.partition("|")
        if not _:
            raise ParseError(source, first_line + i, "no bar", line)
        labels.append(float(label))
        indices += [int(k) & (2**bits - 1) for k in keys.split()] + [bias]
        indptr.append(len(indices))
    return (np.array(labels, np.float32), np.array(indptr, np.int64), np.array(indices, np.uint64),
            np.ones(len(indices), np.float32), 0)


def test_a_registered_format_reads_a_workers_part(tmp_path):
    hpcps.register_format("pipes", parse_pipes)
    assert config.from_dict({"data": {"format": "pipes"}}).data.format == "pipes"
    path = tmp_path / "d.pipes"
    path.write_text("1|3 5\n0|7\n1|300\n")
    ds = tdata.load_part(str(path), 0, 1, "pipes", hash_bits=8)
    bias = int(tdata.BIAS_KEY)
    assert ds.labels.tolist() == [1, 0, 1] and ds.indptr.tolist() == [0, 3, 5, 7]
    assert ds.indices.tolist() == [3, 5, bias, 7, bias, 300 & 255, bias]
    path.write_text("1|3\n0|7\n1 300\n")
    with pytest.raises(tdata.DataError, match=rf"{path}:3: no bar"):  # the line's number in the file
        tdata.load_part(str(path), 0, 1, "pipes")


def test_a_format_is_registered_once():
    hpcps.register_format("pipes", parse_pipes)
    with pytest.raises(ValueError, match="data format 'pipes' is already registered"):
        hpcps.register_format("pipes", parse_pipes)
    hpcps.register_format("pipes", parse_pipes, replace=True)
    for name in ("auto", "libsvm", "criteo", "vw", "libffm"):
        with pytest.raises(ValueError, match=f"data format '{name}' is already registered"):
            hpcps.register_format(name, parse_pipes, replace=True)
    with pytest.raises(config.ConfigError, match=r"data\.format = 'pipez': expected one of .*'pipes'"):
        config.from_dict({"data": {"format": "pipez"}})


def test_a_registered_models_file_is_not_served_as_another_model():
    class SvmFile:  # what a model file of a registered model type says of itself
        kind = "svm"

    with pytest.raises(ValueError, match="a model of type 'svm' .* cannot be served from its file"):
        models.Scorer(SvmFile())
