"""What a worker says of an error that left the user's code (worker/bootstrap.py _on_error): a peer's
death seen in a collective waits for the first-hand record; the same words from the user's own
client are this rank's error, with its traceback."""

import sys
from types import SimpleNamespace

import pytest

from ddprun.protocol import defaults
from ddprun.worker import bootstrap

TORCH_FRAME = "def collective():\n    raise RuntimeError('[gloo] Connection reset by peer')\n"


def raised(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def channel(waited: list, first_end=None):
    return SimpleNamespace(cause=lambda: None, await_cause=lambda s: waited.append(s),
                           me=lambda kind, text, hint="": (kind, text), first_clean_end=lambda: first_end,
                           stopped=lambda cause, seen="": ("stopped", cause, seen), ack_failure=lambda: None,
                           last_attempt=True)  # no restart follows: the cause's log keeps its name


@pytest.fixture
def recorded(monkeypatch):
    out: list = []
    monkeypatch.setattr(bootstrap.ddp_exit, "record", lambda rec, ch, e=None, **kw: out.append(rec))
    monkeypatch.setattr(bootstrap, "_known_failure", lambda e: None)
    return out


def test_a_connection_error_from_the_users_own_client_is_this_ranks_error(recorded, capsys):
    def log_metrics():
        raise ConnectionRefusedError(111, "Connection refused")

    waited: list = []
    bootstrap._on_error(raised(log_metrics), channel(waited))
    err = capsys.readouterr().err
    assert waited == [] and "Traceback" in err and "in log_metrics" in err and "a peer went away" not in err
    assert recorded == [("error", "ConnectionRefusedError: [Errno 111] Connection refused")]


def test_a_peers_death_seen_in_a_torch_collective_waits_for_the_first_hand_record(recorded, capsys):
    scope: dict = {}
    exec(compile(TORCH_FRAME, "/site-packages/torch/distributed/fake.py", "exec"), scope)
    waited: list = []
    bootstrap._on_error(raised(scope["collective"]), channel(waited))
    err = capsys.readouterr().err
    assert waited == [defaults.ECHO_WAIT_S] and "a peer went away" in err and "Traceback" not in err


def test_what_counts_as_raised_in_torch():
    scope: dict = {}
    exec(compile(TORCH_FRAME, "/site-packages/torch/distributed/fake.py", "exec"), scope)
    from_torch = raised(scope["collective"])
    assert bootstrap.raised_in_torch(from_torch)

    def wait_on_work():  # Work.wait() raises from C++: no torch frame, the backend's words
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    assert bootstrap.raised_in_torch(raised(wait_on_work))

    def wrapped():  # the user's wrapper around a collective
        try:
            scope["collective"]()
        except RuntimeError as inner:
            raise ValueError("step failed: Connection reset by peer") from inner

    assert bootstrap.raised_in_torch(raised(wrapped))

    def through_a_module():  # the user's client called in forward: torch frames outside, the client's inside
        exec(compile("def forward():\n    client()\n", "/site-packages/torch/nn/modules/module.py", "exec"), scope)
        scope["client"] = lambda: (_ for _ in ()).throw(ConnectionRefusedError(111, "Connection refused"))
        scope["forward"]()

    assert not bootstrap.raised_in_torch(raised(through_a_module))
    loader = RuntimeError("Caught ConnectionRefusedError in DataLoader worker process 0.\nConnection refused")
    assert not bootstrap.raised_in_torch(loader)


def test_a_peers_death_after_that_peer_ended_its_script_names_it_as_having_finished_first(recorded, capsys):
    """Uneven data: the peer's script ended (exit 0) while this rank waited for it in a collective."""
    from ddprun.protocol import failure as fr

    scope: dict = {}
    exec(compile(TORCH_FRAME, "/site-packages/torch/distributed/fake.py", "exec"), scope)
    end = fr.CleanEnd(rank=1, node_rank=1, host="b", local_rank=0, steps=5, t=100.0)
    bootstrap._on_error(raised(scope["collective"]), channel([], first_end=end))
    [(kind, cause, seen)] = recorded
    assert kind == "stopped" and cause == fr.finished_first(end) and seen.startswith("RuntimeError: [gloo] Connection")
    assert cause.headline() == ("rank 1 (node 1, b) finished first: its script ended (exit 0) after 5 optimizer steps "
                                "while another rank still waited for it in a collective")
    assert not cause.is_echo and cause.hint.startswith("every rank must call the same collectives")
    err = capsys.readouterr().err
    assert err.startswith("ddprun: stopped because rank 1 (node 1, b) finished first: its script ended"), err


def test_a_script_that_turns_a_peers_death_into_sys_exit_is_that_peers_echo_not_the_cause(recorded, capsys):
    # a wrapper (Hydra's) catches the collective's error and calls sys.exit(1): recorded first-hand at
    # once, "SystemExit(1)" took the blame from the OOM-killed rank whose agent wrote a moment later
    scope: dict = {}
    exec(compile(TORCH_FRAME, "/site-packages/torch/distributed/fake.py", "exec"), scope)

    def main():
        try:
            scope["collective"]()
        except RuntimeError:
            sys.exit(1)  # sets __context__ as Hydra's does

    waited: list = []
    bootstrap._on_failed_exit(raised(main), 1, channel(waited))
    assert waited == [defaults.ECHO_WAIT_S] and "a peer went away" in capsys.readouterr().err
    assert recorded == [("error", "RuntimeError: [gloo] Connection reset by peer")]  # no cause came: not SystemExit(1)
    recorded.clear()

    def plain():  # the script's own exit code, no error behind it
        raise SystemExit(3)

    bootstrap._on_failed_exit(raised(plain), 3, SimpleNamespace(me=lambda kind, text, exit_code=0: (kind, text)))
    assert recorded == [("error", "SystemExit(3)")]


def test_a_ranks_own_error_after_a_peers_record_keeps_its_traceback(monkeypatch, capsys):
    # rank 5's own "loss is NaN" came after rank 3's record: it is stopped by rank 3 (one cause), but
    # its traceback was lost, on the console and in its error file
    from ddprun.protocol import failure as fr

    out: list = []
    monkeypatch.setattr(bootstrap.ddp_exit, "record", lambda rec, ch, e=None, **kw: out.append((rec, e)))
    monkeypatch.setattr(bootstrap, "_known_failure", lambda e: None)
    first = fr.FailureRecord(fr.ERROR, 3, "RuntimeError: CUDA error", 0, "host-b")
    ch = SimpleNamespace(cause=lambda: first, stopped=lambda cause, seen="": ("stopped", cause.rank, seen),
                         ack_failure=lambda: None, last_attempt=True)

    def train_step():
        raise ValueError("loss is NaN")

    error = raised(train_step)
    bootstrap._on_error(error, ch)
    err = capsys.readouterr().err
    assert "Traceback" in err and "in train_step" in err and "ValueError: loss is NaN" in err
    assert out == [(("stopped", 3, "ValueError: loss is NaN"), error)]
