"""Cloud preemption notices (agent/spot.py) against a local metadata server: AWS's IMDSv2 token
and its 404 turning into a notice, GCP's FALSE turning TRUE, a server that does not answer, and bad
settings."""

import io
import time

import pytest

from ddprun.agent import spot
from ddprun.errors import ConfigError
from tests.fakes.metadata import Metadata, serve


@pytest.fixture
def server():
    httpd, url = serve()
    yield url
    httpd.shutdown()


def test_aws_no_notice_is_a_404_then_the_notice_names_action_and_time(server):
    assert spot.aws_notice(server) is None
    Metadata.notice = True
    assert spot.aws_notice(server) == "an AWS spot interruption notice (terminate at 2026-12-01T18:40:00Z)"
    assert ("PUT", "/latest/api/token", "300") in Metadata.seen  # IMDSv2: a token first, then used
    assert ("GET", "/latest/meta-data/spot/instance-action", "tok", None) in Metadata.seen


def test_gcp_false_then_true(server):
    assert spot.gcp_notice(server) is None
    Metadata.notice = True
    assert spot.gcp_notice(server) == "a GCP preemption notice"
    assert Metadata.seen[-1] == ("GET", "/computeMetadata/v1/instance/preempted", None, "Google")


def test_the_watch_hands_over_the_first_notice_once_and_says_once_when_the_server_is_away(server):
    got = []
    watch = spot.SpotWatch("aws", server, 0.05, got.append).start()
    time.sleep(0.3)
    assert got == []
    Metadata.notice = True
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    watch.stop()
    assert got == ["an AWS spot interruption notice (terminate at 2026-12-01T18:40:00Z)"]
    out = io.StringIO()
    away = spot.SpotWatch("gcp", "http://127.0.0.1:1", 0.05, got.append, out).start()
    time.sleep(0.4)
    away.stop()
    assert out.getvalue().count("ddprun: note: the gcp instance metadata at http://127.0.0.1:1 did not answer") == 1


def test_settings_take_the_url_and_poll_from_the_environment_and_name_bad_values():
    assert spot.settings("aws", {}) == ("http://169.254.169.254", 5.0)
    assert spot.settings("gcp", {"DDPRUN_SPOT_NOTICE_URL": "http://proxy:80/", "DDPRUN_SPOT_NOTICE_POLL_S": "1"}) == \
        ("http://proxy:80", 1.0)
    with pytest.raises(ConfigError, match="DDPRUN_SPOT_NOTICE_POLL_S='soon'"):
        spot.settings("aws", {"DDPRUN_SPOT_NOTICE_POLL_S": "soon"})
    with pytest.raises(ConfigError, match="--spot-notice azure"):
        spot.settings("azure", {})
