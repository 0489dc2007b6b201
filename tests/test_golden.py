"""Golden runs (``tests/golden.py``): LR, FM and DeepFM under BSP on 1 server + 2 workers, one
process, and a resume from 1 server onto 2, each training the model recorded in
``tests/golden/<name>.json`` (at 84dd809, before the redesign of issue 37): bit for bit on the
platform it was recorded on, to a relative 1e-5 elsewhere."""

from __future__ import annotations

import json

import pytest

import golden


@pytest.mark.parametrize("name", list(golden.RUNS))
def test_a_golden_run_trains_the_recorded_model(name, tmp_path):
    want = json.load(open(golden.golden_path(name)))
    got = golden.run(name, str(tmp_path))
    problems = golden.compare(name, got, want)
    assert not problems, "\n".join(problems)
    if want["platform"] != golden.platform_key():
        print(f"{name}: another platform than the golden's ({want['platform']}): compared to a relative 1e-5")
