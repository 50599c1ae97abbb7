"""The report opens in a real headless Chromium: its plots render (decoded, non-empty), the summary card
and the events are on the page, and a screenshot of it is a drawn page, not a blank one."""

import os
import re
import shutil
import signal
import subprocess

import pytest

from tests.system import unavailable
from tests.unit.test_report import PLOTS, make_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.fixture(autouse=True)
def needs_chromium():
    if CHROMIUM is None:
        unavailable("Debian's chromium is not installed (.ci/run installs it)")


def chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    """Chromium in its own session, so that on a timeout its whole process tree is killed, not just
    the browser process (its renderer and GPU helpers would outlive it)."""
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also a helper left behind by a browser that exited
        except ProcessLookupError:
            pass
        proc.wait(10)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.timeout(150)
def test_report_renders_its_plots_in_headless_chromium(tmp_path):
    from ddprun.report import write_report

    make_run(tmp_path)
    path = write_report(str(tmp_path))
    out = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", f"file://{path}")
    body = re.search(r"<body[^>]*>", out.stdout)
    assert body, out.stderr[-2000:]
    # set by the page's own script after load: plot images that decoded with a non-zero width
    assert f'data-rendered="{len(PLOTS)}"' in body.group(0), body.group(0)
    assert re.search(r"<dt>world</dt><dd>2 ranks on 1 node\(s\)</dd>", out.stdout)
    assert "<td>preemption</td>" in out.stdout and "<td>straggler</td>" in out.stdout


@pytest.mark.timeout(150)
def test_report_screenshot_is_a_drawn_page(tmp_path):
    import matplotlib.image

    from ddprun.report import write_report

    make_run(tmp_path)
    path = write_report(str(tmp_path))
    shot = tmp_path / "report.png"
    out = chromium(tmp_path, "--window-size=1100,3200", f"--screenshot={shot}", f"file://{path}")
    assert shot.exists(), out.stderr[-2000:]
    pixels = matplotlib.image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (3200, 1100)
    # plots, text and the card: many distinct colours, and a large share of the page is not background
    colours = {tuple(p) for p in (pixels[::7, ::7].reshape(-1, 3) * 255).astype(int).tolist()}
    assert len(colours) > 200
    ink = pixels.min(axis=2) < 0.9
    assert ink.mean() > 0.02, ink.mean()
    # the card, the table, five plots and the events run down the page: many rows carry ink, far down
    inked_rows = ink.any(axis=1).nonzero()[0]
    assert len(inked_rows) > 1000 and inked_rows.max() > 2000, (len(inked_rows), inked_rows.max())
