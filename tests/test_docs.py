"""The documentation: the site builds under ``mkdocs build --strict`` (every page in the
navigation, every link between pages resolving), the configuration page is what the
configuration's definitions generate, and the README stays short and points into docs/."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configuration_page_is_generated_from_the_definitions():
    path = os.path.join(ROOT, "docs", "configuration.md")
    with open(path) as f:
        text = f.read()
    generator = runpy.run_path(os.path.join(ROOT, "docs", "configuration.py"))
    assert generator["page"](text) == text, \
        "docs/configuration.md is stale: regenerate it with `.venv/bin/python docs/configuration.py`"
    assert "`cluster.servers`" in text and "`features.count_bits`" in text


def test_the_site_builds_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", os.path.join(ROOT, "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "site" / "configuration" / "index.html") as f:
        assert "data.hash_bits" in f.read()
    with open(tmp_path / "site" / "operations" / "index.html") as f:
        assert "what survives what" in f.read().lower()


def test_readme_is_short_and_its_links_resolve():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text  # the two commands (.ci/run runs make test)
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(t.startswith("docs/") for t in targets)
    missing = [t for t in targets if not t.startswith("http") and not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, missing
