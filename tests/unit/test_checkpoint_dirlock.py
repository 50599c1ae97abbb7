"""One writing job per checkpoint directory (train/dirlock.py): another run's writer is refused by
name and deletes nothing; an earlier attempt of the same run, a holder that ends, and the forked
children of a holder that ended never stop a job."""

import os
import threading
import time

import pytest
import torch
from torch import nn

import ddprun
from ddprun.errors import CheckpointError
from ddprun.train import dirlock
from tests.helpers import fork
from tests.unit.restart_support import new_process, one_process, regression  # noqa: F401 (autouse fixture)


class Holder:
    """A forked process holding a directory's lock as another writer would, until :meth:`end`."""

    def __init__(self, directory, run, mode):
        said_r, said_w = os.pipe()
        self._go_r, self._go_w = os.pipe()
        self.pid = fork()
        if self.pid == 0:  # the child: fcntl and os calls only, then os._exit
            os.close(self._go_w)  # else its own copy keeps the pipe open: no EOF
            os.close(said_r)
            code = 0
            try:
                dirlock.acquire(directory, run)
                if mode == "fork" and fork() == 0:  # a DataLoader worker forked by the writer, living on
                    os.read(self._go_r, 1)
                    os._exit(0)
                if mode == "fork":
                    dirlock.release()
                os.write(said_w, b"h")
                os.read(self._go_r, 1)
            except BaseException:  # noqa: BLE001 - the parent sees no "h"
                code = 1
            os._exit(code)
        os.close(said_w)
        assert os.read(said_r, 1) == b"h"
        os.close(said_r)

    def end(self):
        """Let it (and a child of it) end; its wait status. Once."""
        os.close(self._go_w)  # every reader of the pipe (the child, its child) sees EOF
        os.close(self._go_r)
        self.status = os.waitpid(self.pid, 0)[1]
        return self.status


@pytest.fixture
def holder(tmp_path):
    """``start(run, mode)``: a process of the run tmp_path/<run> holding tmp_path/ck's lock until the
    test ends (or, mode "fork": one that forked a child, then let go itself; the child lives on)."""
    started = []

    def start(run, mode="hold"):
        started.append(Holder(str(tmp_path / "ck"), str(tmp_path / run), mode))
        return started[-1]

    (tmp_path / "ck").mkdir()
    yield start
    for h in started:
        if not hasattr(h, "status"):
            h.end()
    dirlock.release()


def fit(tmp_path, **kw):
    new_process()
    return ddprun.fit(nn.Linear(8, 1), regression(), loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=2,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), run_dir=str(tmp_path / "run"),
                      checkpoint_dir=str(tmp_path / "ck"), log_every=100, **kw)


def test_a_fit_of_another_run_is_refused_by_name_and_deletes_none_of_the_writers_files(tmp_path, holder,
                                                                                        monkeypatch):
    # another run: another run directory (a rendezvous id may be every job's: torchrun's "none")
    monkeypatch.setattr(dirlock, "WAIT_S", 0.5)
    other = holder("sweep-a")
    in_flight = tmp_path / "ck" / ".step-00000040.pt.k3j2.tmp"  # the other job's save, being written
    in_flight.write_bytes(b"x")
    with pytest.raises(CheckpointError) as err:
        fit(tmp_path)
    msg = str(err.value)
    assert msg.startswith("Another job writes checkpoints in this directory.\nSeen: ")
    assert f"pid {other.pid} (run {tmp_path / 'sweep-a'}, since " in msg
    assert "HINT: Give each job its own checkpoint_dir" in msg and f"remove {dirlock.LOCK_NAME} there" in msg
    assert in_flight.exists() and not (tmp_path / "ck" / "latest").exists()


def test_an_earlier_attempt_of_the_same_run_does_not_stop_its_writer(tmp_path, holder):
    # e.g. a rank 0 cut off on a node the job re-formed without, its NFS lock not yet expired
    holder("run")  # fit's run_dir below
    t0 = time.monotonic()
    assert fit(tmp_path).steps == 2
    assert time.monotonic() - t0 < dirlock.WAIT_S  # not waited for
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="Another job"):  # another run waits its bound, then is refused
        dirlock.acquire(str(tmp_path / "ck"), str(tmp_path / "sweep-b"), wait_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 2


def test_lock_calls_that_do_not_answer_leave_the_fit_unchecked_with_a_warning(tmp_path, monkeypatch):
    # NFSv3 with its lock manager gone: a lock call can block in the kernel
    monkeypatch.setattr(dirlock, "CALL_S", 0.2)
    monkeypatch.setattr(dirlock, "_try_lock", lambda *a: time.sleep(5))
    (tmp_path / "ck").mkdir()
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="did not answer its lock call within 0.7 s"):
        dirlock.acquire(str(tmp_path / "ck"), str(tmp_path / "run"), wait_s=0.5)
    assert time.monotonic() - t0 < 3 and dirlock._HELD == {}


def test_a_holder_that_ends_within_the_wait_lets_the_fit_in(tmp_path, holder):
    h = holder("sweep-a")
    ending = threading.Timer(0.5, h.end)  # it ends while the fit waits: a relaunch right after a stop
    ending.start()
    assert fit(tmp_path).steps == 2
    ending.join(10)
    assert h.status == 0


def test_a_forked_child_of_a_writer_that_let_go_holds_nothing(tmp_path, holder, monkeypatch):
    monkeypatch.setattr(dirlock, "WAIT_S", 0.5)
    holder("sweep-a", mode="fork")  # its child still runs
    assert fit(tmp_path).steps == 2


def test_fit_lets_go_at_its_end_and_when_it_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(dirlock, "WAIT_S", 0.5)
    fit(tmp_path)
    assert dirlock._HELD == {}
    other = Holder(str(tmp_path / "ck"), str(tmp_path / "another"), "hold")  # another process takes it at once
    assert os.WEXITSTATUS(other.end()) == 0
    with pytest.raises(ValueError):
        fit(tmp_path, scheduler=lambda opt: (_ for _ in ()).throw(ValueError("bad scheduler")))
    assert dirlock._HELD == {}
    assert os.path.exists(tmp_path / "ck" / dirlock.LOCK_NAME)


def refused_elsewhere(directory, run):
    """Whether a forked process of ``run`` is refused ``directory``'s lock (a second job's writer)."""
    pid = fork()
    if pid == 0:  # the child: dirlock and os calls only, then os._exit
        code = 1
        try:
            dirlock._HELD.clear()  # the parent's: this process takes its own
            dirlock.acquire(directory, run, wait_s=0.2)
            code = 0
        except CheckpointError:
            code = 3
        except BaseException:  # noqa: BLE001 - the parent sees 1
            pass
        os._exit(code)
    return os.WEXITSTATUS(os.waitpid(pid, 0)[1]) == 3


def test_the_writer_keeps_its_lock_when_its_process_opens_and_closes_the_lock_file(tmp_path):
    # a POSIX lock (lockf) is dropped when its process closes any descriptor of the file: an
    # on_checkpoint hook that tarred the checkpoint directory released it, and a second job got in
    import tarfile

    ck = tmp_path / "ck"
    ck.mkdir()
    dirlock.acquire(str(ck), str(tmp_path / "run"))
    try:
        assert refused_elsewhere(str(ck), str(tmp_path / "sweep-b"))
        with tarfile.open(tmp_path / "upload.tar", "w") as tar:
            tar.add(ck, arcname="ck")  # opens and closes ck/.ddprun-writer.lock
        with open(ck / dirlock.LOCK_NAME) as f:
            assert f"(run {tmp_path / 'run'}, since " in dirlock._describe(dirlock._holder(f.fileno()))
        assert refused_elsewhere(str(ck), str(tmp_path / "sweep-b"))
    finally:
        dirlock.release()
    assert not refused_elsewhere(str(ck), str(tmp_path / "sweep-b"))  # released: the next job gets in
