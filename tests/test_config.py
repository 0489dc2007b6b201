"""Configuration: closed key set, types, overrides, choices."""

import pytest

from hpcps import config


def test_defaults_and_overrides():
    cfg = config.from_dict(config.load_raw(None, ["train.epochs=3", "optimizer.alpha=0.2", "data.format=criteo",
                                                  "cluster.worker_groups=2", "train.aggregate=false"]))
    assert cfg.train.epochs == 3 and cfg.optimizer.params == {"alpha": 0.2}
    assert cfg.data.format == "criteo" and cfg.cluster.worker_groups == 2 and cfg.train.aggregate is False
    assert cfg.optimizer.name == "ftrl"


def test_toml_file_and_override_merge(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\ntype = "fm"\nfactors = 4\n[optimizer]\nname = "adagrad"\nlr = 0.05\n')
    cfg = config.from_dict(config.load_raw(str(p), ["model.factors=16"]))
    assert (cfg.model.type, cfg.model.factors, cfg.optimizer.name, cfg.optimizer.params) == ("fm", 16, "adagrad", {"lr": 0.05})


@pytest.mark.parametrize("override,match", [
    ("train.epochz=3", r"unknown config key train\.epochz"),
    ("trian.epochs=3", r"unknown config section \[trian\]"),
    ("train.epochs=three", r"train\.epochs: expected int"),
    ("train.epochs=0", r"train\.epochs must be at least 1"),
    ("model.type=svm", r"model\.type = 'svm': expected one of"),
    ("optimizer.lr=0.1", r"unknown config key optimizer\.lr for optimizer 'ftrl'"),
    ("optimizer.name=rmsprop", r"optimizer\.name = 'rmsprop'"),
    ("data.hash_bits=65", r"data\.hash_bits must be between 1 and 64"),
    ("epochs", r"expected section\.key=value"),
])
def test_bad_config_names_the_key(override, match):
    with pytest.raises(config.ConfigError, match=match):
        config.from_dict(config.load_raw(None, [override]))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(config.ConfigError, match="not found"):
        config.load_raw(str(tmp_path / "nope.toml"), [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs = 1\n")
    with pytest.raises(config.ConfigError, match="bad.toml"):
        config.load_raw(str(bad), [])


def test_fingerprint_changes_with_any_value():
    a = config.from_dict({})
    b = config.from_dict({"train": {"epochs": 5}})
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() == config.from_dict({}).fingerprint()


def test_ftrl_l2_defaults_to_10_for_the_factor_models_under_the_logistic_loss():
    def l2(**sections):
        return config.from_dict(sections).optimizer.params.get("l2")
    assert l2() is None and l2(model={"type": "fm", "loss": "squared"}) is None  # the registry's 0
    assert l2(model={"type": "fm"}) == l2(model={"type": "wdl"}) == l2(model={"type": "deepfm"}) == 10.0
    assert l2(model={"type": "fm"}, optimizer={"l2": 0}) == 0.0  # a setting wins
    assert l2(model={"type": "fm"}, optimizer={"name": "adagrad"}) is None


def test_fingerprint_differences_name_the_settings():
    a = config.from_dict({"model": {"type": "fm"}, "optimizer": {"l2": 0}, "data": {"hash_bits": 20}})
    b = config.from_dict({"model": {"type": "fm", "factors": 4}, "data": {"hash_bits": 22}, "train": {"epochs": 9}})
    assert config.fingerprint_differences(a.to_dict(), b.to_dict()) == [
        "data.hash_bits was 20, now 22", "model.factors was 8, now 4", "optimizer.l2 was 0.0, now 10.0"]
    d = config.from_dict({"model": {"type": "fm"}, "optimizer": {"l2": 0, "alpha": 0.5}, "data": {"hash_bits": 20}})
    assert config.fingerprint_differences(d.to_dict(), a.to_dict()) == ["optimizer.alpha was 0.5, now its default"]
    # the data paths, the epochs and the layout are not fingerprinted: a run may go on with others
    c = config.from_dict({"model": {"type": "fm"}, "optimizer": {"l2": 0}, "cluster": {"servers": 3},
                          "data": {"hash_bits": 20, "train": "other.svm"}, "train": {"epochs": 9, "model_out": "x.h5"}})
    assert a.to_dict() != c.to_dict() and config.fingerprint_differences(a.to_dict(), c.to_dict()) == []
