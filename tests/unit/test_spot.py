"""Cloud preemption notices (agent/spot.py) against a local metadata server: AWS's IMDSv2 token
and its 404 turning into a notice, GCP's FALSE turning TRUE, a server that does not answer, and bad
settings."""

import importlib
import io
import time

import pytest

from ddprun.agent import spot
from ddprun.errors import ConfigError
from tests.fakes.metadata import Metadata, serve


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


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


def test_the_watch_hands_over_the_first_notice_once(server):
    got = []
    watch = spot.SpotWatch("aws", server, 0.05, got.append).start()
    time.sleep(0.3)
    assert got == []
    Metadata.notice = True
    assert wait_for(lambda: got)
    time.sleep(0.2)  # a second call would come within 4 polls
    watch.stop()
    assert got == ["an AWS spot interruption notice (terminate at 2026-12-01T18:40:00Z)"]


def test_a_server_that_does_not_answer_is_named_once_however_often_it_is_polled(server):
    """A refused port: the note comes. A server that answers every poll with an error (404 under a
    wrong base path), whose requests the fake counts: still one note after at least 5 failed polls."""
    got, out = [], io.StringIO()
    refused = spot.SpotWatch("gcp", "http://127.0.0.1:1", 0.05, got.append, out).start()
    assert wait_for(lambda: "did not answer" in out.getvalue())
    refused.stop()
    assert out.getvalue().startswith("ddprun: note: the gcp instance metadata at http://127.0.0.1:1 did not answer")
    out = io.StringIO()
    wrong = spot.SpotWatch("gcp", server + "/nosuch", 0.05, got.append, out).start()
    assert wait_for(lambda: len(Metadata.seen) >= 5)
    wrong.stop()
    assert out.getvalue().count(f"ddprun: note: the gcp instance metadata at {server}/nosuch did not answer") == 1
    assert got == []


def test_settings_take_the_url_and_poll_from_the_environment_and_name_bad_values():
    assert spot.settings("aws", {}) == ("http://169.254.169.254", 5.0)
    assert spot.settings("gcp", {"DDPRUN_SPOT_NOTICE_URL": "http://proxy:80/", "DDPRUN_SPOT_NOTICE_POLL_S": "1"}) == \
        ("http://proxy:80", 1.0)
    with pytest.raises(ConfigError, match="DDPRUN_SPOT_NOTICE_POLL_S='soon'"):
        spot.settings("aws", {"DDPRUN_SPOT_NOTICE_POLL_S": "soon"})
    with pytest.raises(ConfigError, match="--spot-notice azure"):
        spot.settings("azure", {})


class V1Only(Metadata):
    """An instance that has IMDSv2 off: the token PUT is refused (405, as with a hop limit hit)."""

    def do_PUT(self):  # noqa: N802 - http.server's names
        self.seen.append(("PUT", self.path, self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")))
        self._send(405)


def test_aws_without_a_token_asks_imdsv1_style_and_still_reads_the_notice():
    import threading
    from http.server import ThreadingHTTPServer

    Metadata.notice, Metadata.seen = True, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), V1Only)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert spot.aws_notice(base) == "an AWS spot interruption notice (terminate at 2026-12-01T18:40:00Z)"
    finally:
        httpd.shutdown()
    assert Metadata.seen == [("PUT", "/latest/api/token", "300"),
                             ("GET", "/latest/meta-data/spot/instance-action", None, None)]  # no token header


def test_a_proxy_in_the_environment_is_never_used_for_the_link_local_server(server, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:1")  # a proxy that refuses: using it would fail
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    fresh = importlib.reload(spot)  # urllib reads proxies when an opener is built: at import
    try:
        assert fresh.gcp_notice(server) is None
        assert Metadata.seen == [("GET", "/computeMetadata/v1/instance/preempted", None, "Google")]
    finally:
        monkeypatch.undo()
        importlib.reload(spot)


def test_a_reply_cut_short_is_a_poll_that_failed_and_the_watch_goes_on(monkeypatch):
    # http.client's IncompleteRead and BadStatusLine are no OSError: the thread died with a traceback
    # and no later notice was seen
    import http.client

    answers = iter([http.client.IncompleteRead(b"TR"), http.client.BadStatusLine("")])

    def flaky(base):
        for e in answers:
            raise e
        return "a GCP preemption notice"

    monkeypatch.setitem(spot.CHECKS, "gcp", flaky)
    got, out = [], io.StringIO()
    watch = spot.SpotWatch("gcp", "http://metadata", 0.01, got.append, out).start()
    assert wait_for(lambda: got)
    watch.stop()
    assert got == ["a GCP preemption notice"]
    assert out.getvalue().count("did not answer (IncompleteRead: ") == 1
