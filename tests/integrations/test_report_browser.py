"""The report opens in a real headless Chromium and its plots render (decoded, non-empty)."""

import re
import shutil
import subprocess

import pytest

from tests.unit.test_report import make_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.timeout(90)
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_its_plots_in_headless_chromium(tmp_path):
    from ddprun.report import write_report

    make_run(tmp_path)
    path = write_report(str(tmp_path))
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", f"file://{path}"],
        capture_output=True, text=True, timeout=60)
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    # set by the page's own script after load: plot images that decoded with a non-zero width
    assert 'data-rendered="4"' in body.group(0), body.group(0)
