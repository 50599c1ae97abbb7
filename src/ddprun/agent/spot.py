"""Cloud preemption notices (``ddprun run --spot-notice aws|gcp``, off by default).

A daemon thread polls the instance metadata every ``DDPRUN_SPOT_NOTICE_POLL_S`` seconds (default
5, as AWS advises) and hands the first notice to the agent's preemption as if it were a signal
(agent/preemption.py): every rank stops after one agreed step with ddprun.fit's checkpoint, before
the cloud takes the machine (AWS: two minutes after the notice; GCP: 30 s).

- AWS: an IMDSv2 token (IMDSv1 if none is given), then ``/latest/meta-data/spot/instance-action``:
  404 until the notice, then ``{"action": "terminate"|"stop"|"hibernate", "time": ...}``.
- GCP: ``/computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: ``FALSE``,
  then ``TRUE``.

``DDPRUN_SPOT_NOTICE_URL`` replaces the metadata server's address (a proxy, or a test's server).
Proxies from the environment are never used: the metadata server is link-local.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from ddprun.errors import ConfigError

KINDS = ("off", "aws", "gcp")
BASES = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
POLL_S = 5.0
REQUEST_TIMEOUT_S = 2.0
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, headers: Mapping[str, str], method: str = "GET") -> str:
    req = urllib.request.Request(url, headers=dict(headers), method=method)
    with _NO_PROXY.open(req, timeout=REQUEST_TIMEOUT_S) as r:
        return r.read().decode(errors="replace")


def aws_notice(base: str) -> str | None:
    """The AWS spot interruption notice as one phrase, or None (404: no notice yet)."""
    try:
        token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
    except (urllib.error.URLError, OSError):
        token = ""  # IMDSv1 only
    try:
        body = _get(f"{base}/latest/meta-data/spot/instance-action",
                    {"X-aws-ec2-metadata-token": token} if token else {})
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise
    try:
        d = json.loads(body)
        return f"an AWS spot interruption notice ({d.get('action', '?')} at {d.get('time', '?')})"
    except (ValueError, AttributeError):
        return "an AWS spot interruption notice"


def gcp_notice(base: str) -> str | None:
    """The GCP preemption notice as one phrase, or None (``FALSE``)."""
    body = _get(f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
    return "a GCP preemption notice" if body.strip().upper() == "TRUE" else None


CHECKS: dict[str, Callable[[str], str | None]] = {"aws": aws_notice, "gcp": gcp_notice}


def settings(kind: str, environ: Mapping[str, str]) -> tuple[str, float]:
    """(metadata base URL, poll seconds) for ``kind``; ConfigError naming a bad value."""
    if kind not in KINDS:
        raise ConfigError("--spot-notice takes off, aws or gcp.", seen=f"--spot-notice {kind}",
                          hint="e.g. --spot-notice aws on EC2 spot instances.")
    raw = environ.get("DDPRUN_SPOT_NOTICE_POLL_S", "")
    try:
        poll = float(raw) if raw else POLL_S
    except ValueError:
        poll = -1.0
    if not 0 < poll < float("inf"):
        raise ConfigError("DDPRUN_SPOT_NOTICE_POLL_S must be a number of seconds > 0.",
                          seen=f"DDPRUN_SPOT_NOTICE_POLL_S={raw!r}", hint="unset it (default 5).")
    return environ.get("DDPRUN_SPOT_NOTICE_URL", "").rstrip("/") or BASES.get(kind, ""), poll


class SpotWatch:
    """The polling thread; ``on_notice(phrase)`` is called once, from it (a flag, nothing more)."""

    def __init__(self, kind: str, base: str, poll_s: float, on_notice: Callable[[str], Any],
                 out: TextIO = sys.stderr):
        """``base``, ``poll_s``: from :func:`settings`."""
        self.kind, self.base, self.poll_s = kind, base, poll_s
        self.on_notice, self.out = on_notice, out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddprun-spot-notice", daemon=True)

    def start(self) -> SpotWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        said = False
        while not self._stop.is_set():
            try:
                notice = CHECKS[self.kind](self.base)
            # HTTPException (IncompleteRead, BadStatusLine: a reply cut short) is no OSError
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                notice = None
                if not said:  # once: a node outside the cloud, or a blocked metadata server
                    said = True
                    print(f"ddprun: note: the {self.kind} instance metadata at {self.base} did not answer "
                          f"({type(e).__name__}: {e}); still watching for a preemption notice",
                          file=self.out, flush=True)
            if notice:
                self.on_notice(notice)
                return
            self._stop.wait(self.poll_s)
