"""DataLoader defaults that don't hang, and samplers that shard the way DDP equivalence needs."""

import warnings

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

from ddprun.errors import ConfigError
from ddprun.runtime import RankInfo
from ddprun.train.data import (
    ShardSampler,
    build_train_loader,
    build_val_loader,
    choose_num_workers,
    loader_options,
    worker_bound,
)


def rank(r=0, world=1, local_world=1, device="cpu"):
    return RankInfo(rank=r, local_rank=r % local_world, node_rank=r // local_world, world_size=world,
                    local_world_size=local_world, device=torch.device(device), is_main=r == 0)


class Squares(Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


def tensors(n=48):
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n).float())


def test_worker_bound_shares_cpus_between_local_ranks():
    assert worker_bound(2, cpus=16) == 8
    assert worker_bound(4, cpus=2) == 0


def test_default_workers_and_caps():
    assert choose_num_workers(None, Squares(), 2, cpus=16) == 2
    assert choose_num_workers(None, Squares(), 2, cpus=2) == 1
    assert choose_num_workers(None, tensors(), 1, cpus=16) == 0  # in-memory tensors: no worker processes
    assert choose_num_workers(3, Squares(), 1, cpus=16) == 3
    with pytest.warns(UserWarning, match="using 1"):
        assert choose_num_workers(8, Squares(), 2, cpus=2) == 1
    with pytest.raises(ConfigError, match="HINT"):
        choose_num_workers(-1, Squares(), 1, cpus=4)


class Stream(IterableDataset):
    """A stream that does not split itself between DataLoader workers (module level: picklable)."""

    def __iter__(self):
        return iter(torch.arange(12).float().unsqueeze(1))


def test_an_iterable_dataset_gets_no_workers_by_default_and_asked_for_ones_come_with_a_warning(monkeypatch):
    # each worker iterates the whole stream: 2 default workers trained on every sample twice, silently
    monkeypatch.setattr("ddprun.train.data.cpu_count", lambda: 16)
    assert choose_num_workers(None, Stream(), 1, cpus=16) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        built = build_train_loader(Stream(), batch_size=4, info=rank(), seed=0, num_workers=None)
        assert built.loader.num_workers == 0
        assert sorted(v for b in built.loader for v in b.squeeze(1).tolist()) == list(range(12))  # each once
        assert build_val_loader(Stream(), batch_size=4, info=rank(), num_workers=None).num_workers == 0
    with pytest.warns(UserWarning, match=r"train_data is an IterableDataset read by 2 .*get_worker_info"):
        assert build_train_loader(Stream(), batch_size=4, info=rank(), seed=0, num_workers=2).loader.num_workers == 2
    with pytest.warns(UserWarning, match=r"train_data's dataset is an IterableDataset read by 2 "):
        build_train_loader(DataLoader(Stream(), batch_size=4, num_workers=2), batch_size=4, info=rank(), seed=0,
                           num_workers=None)


def test_loader_options_never_fork_and_pin_only_on_cuda():
    assert loader_options(0, "cpu") == {"num_workers": 0, "pin_memory": False}
    opts = loader_options(2, "cuda")
    assert opts["pin_memory"] and opts["persistent_workers"]
    assert opts["multiprocessing_context"] in ("forkserver", "spawn")


def test_a_dataset_gets_a_distributed_sampler_even_in_one_process():
    built = build_train_loader(tensors(), batch_size=8, info=rank(), seed=5, num_workers=None)
    s = built.sampler
    assert isinstance(s, DistributedSampler) and s.shuffle and s.seed == 5 and not s.drop_last
    assert s.num_replicas == 1 and built.loader.num_workers == 0 and built.batch_size == 8


def test_four_ranks_of_batch_b_see_one_process_batch_4b():
    data, b = tensors(64), 4
    one = build_train_loader(data, batch_size=4 * b, info=rank(), seed=3, num_workers=0)
    one.sampler.set_epoch(1)
    ranks = []
    for r in range(4):
        built = build_train_loader(data, batch_size=b, info=rank(r, 4, 2), seed=3, num_workers=0)
        built.sampler.set_epoch(1)
        ranks.append([x.squeeze(1).tolist() for x, _ in built.loader])
    for k, (x, _) in enumerate(one.loader):
        union = sorted(v for r in range(4) for v in ranks[r][k])
        assert union == sorted(x.squeeze(1).tolist())


def test_a_user_loader_with_its_own_sampler_is_kept_in_one_process_and_resharded_in_many():
    own = DataLoader(tensors(), batch_size=6, sampler=range(48))
    assert build_train_loader(own, batch_size=32, info=rank(), seed=0, num_workers=None).loader is own
    # torch's default sampler, in one process too: fit's, which resumes part-way, in the same order
    plain = build_train_loader(DataLoader(tensors(), batch_size=6), batch_size=32, info=rank(), seed=0,
                               num_workers=None)
    assert isinstance(plain.sampler, DistributedSampler) and not plain.sampler.shuffle
    assert [x.squeeze(1).tolist() for x, _ in plain.loader][1] == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    shuffled = build_train_loader(DataLoader(tensors(), batch_size=6, shuffle=True), batch_size=32, info=rank(),
                                  seed=0, num_workers=None)
    assert shuffled.sampler.shuffle and shuffled.batch_size == 6
    custom = DataLoader(tensors(), batch_size=6, sampler=list(range(48)))
    with pytest.warns(UserWarning, match="replaced by a DistributedSampler"):
        built = build_train_loader(custom, batch_size=32, info=rank(0, 2, 2), seed=0, num_workers=None)
    assert built.batch_size == 6 and built.sampler.num_replicas == 2 and len(built.loader) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shuffle=True is no sampler of its own: no warning
        build_train_loader(DataLoader(tensors(), batch_size=6, shuffle=True), batch_size=32, info=rank(0, 2, 2),
                           seed=0, num_workers=None)


class Batches(Dataset):
    """Each item a whole batch of 4 (a DataLoader with batch_size=None: automatic batching off)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        x = torch.arange(4 * i, 4 * i + 4).float()
        return x.unsqueeze(1), x


def test_a_users_loader_rebuilt_in_one_process_keeps_its_workers_start_method_and_settings():
    """In one process fit rebuilds a DataLoader of torch's default sampler only to resume it exactly:
    its workers still start as the user's did (fork here), so a collate_fn or dataset that does not
    pickle still loads (forkserver, fit's own start method, failed it: "Can't pickle local object")."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    user = DataLoader(Squares(), batch_size=5, shuffle=True, num_workers=1, multiprocessing_context=fork,
                      collate_fn=lambda items: torch.cat([y for _, y in items]), prefetch_factor=3, drop_last=True)
    built = build_train_loader(user, batch_size=32, info=rank(), seed=0, num_workers=None)
    assert built.sampler is not None and built.loader.sampler is built.sampler  # resumable
    assert (built.loader.multiprocessing_context, built.loader.prefetch_factor, built.loader.drop_last) == \
        (fork, 3, True)
    batches = list(built.loader)
    assert len(batches) == 10 and sorted(torch.cat(batches).tolist()) == sorted(float(i * i) for i in range(50))


def test_a_loader_of_whole_batches_stays_unbatched_on_every_rank():
    # with 2+ ranks fit rebuilt it with batch_size=32 and its default_convert: lists of 32 whole batches
    user = DataLoader(Batches(), batch_size=None, shuffle=True)
    seen = []
    for r in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's default sampler: nothing of the user's is replaced
            built = build_train_loader(user, batch_size=32, info=rank(r, 2, 2), seed=0, num_workers=None)
        assert built.batch_size == 1 and built.loader.batch_size is None and len(built.loader) == 3
        batches = list(built.loader)
        assert all(x.shape == (4, 1) and y.shape == (4,) for x, y in batches)
        seen += [int(y[0]) // 4 for _, y in batches]
        built.sampler.resume_at(0, 2 * 2)  # two batches taken on each rank: one item each
        assert len(built.loader) == 1
        val = build_val_loader(user, batch_size=32, info=rank(r, 2, 2), num_workers=None)
        assert [y.shape for _, y in val] == [(4,)] * 3
    assert sorted(seen) == list(range(6))


def test_validation_shards_cover_every_sample_once_without_padding():
    shards = [list(ShardSampler(10, r, 3)) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(10))
    assert [len(s) for s in shards] == [4, 3, 3]
    loader = build_val_loader(tensors(10), batch_size=4, info=rank(2, 3, 3), num_workers=None)
    assert [x.squeeze(1).tolist() for x, _ in loader] == [[2.0, 5.0, 8.0]]


def test_not_a_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="TensorDataset"):
        build_train_loader([1, 2, 3], batch_size=2, info=rank(), seed=0, num_workers=None)
    with pytest.raises(ConfigError, match="empty"):
        build_train_loader(tensors(0), batch_size=2, info=rank(), seed=0, num_workers=None)


def mark_worker(worker_id):
    """A user's worker_init_fn (module level: picklable for forkserver)."""
    torch.utils.data.get_worker_info().dataset.marked = True


class Pids(Dataset):
    """Each item: the pid of the worker process that loaded it, and whether the user's init ran there."""

    marked = False

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import os

        return torch.tensor([os.getpid(), int(self.marked)])


def blocked_or_ignored(pid: int) -> int:
    """The SigBlk | SigIgn mask of a process."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(fields["SigBlk"], 16) | int(fields["SigIgn"], 16)


@pytest.mark.timeout(60)
def test_fits_loader_workers_outlive_a_preemption_signal_and_end_with_fit(monkeypatch):
    """SLURM signals every process of a step: fit's DataLoader workers ignore the job's preemption
    signals (SIGUSR1 would kill one, and with it its rank), and so does the forkserver they come from
    (its end ends them); they run the user's worker_init_fn too, and end when fit closes its loaders.
    Another process of the same forkserver keeps the signals' usual meaning (terminate() works)."""
    import multiprocessing
    import os
    import signal
    import time
    from multiprocessing import forkserver

    from ddprun.preempt import PREEMPT
    from ddprun.train.data import close_workers

    forkserver._forkserver._stop()  # one started by another test would not be guarded
    monkeypatch.setattr(PREEMPT, "signals", (signal.SIGTERM, signal.SIGUSR1))
    monkeypatch.setenv("DDPRUN_PREEMPT_SIGNALS", "TERM,USR1")
    user = DataLoader(Pids(), batch_size=4, worker_init_fn=mark_worker)
    loader = build_train_loader(user, batch_size=4, info=rank(0, 2, 2), seed=0, num_workers=1).loader
    first = [int(b[0, 0]) for b in loader]
    (worker,) = set(first)
    assert worker != os.getpid() and all(int(b[0, 1]) for b in loader)  # the user's init ran in the worker
    server = forkserver._forkserver._forkserver_pid
    process = loader._iterator._workers[0]
    other = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(30,))
    try:
        for pid in (worker, server):
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                os.kill(pid, sig)
        time.sleep(0.2)
        assert {int(b[0, 0]) for b in loader} == {worker}  # the same persistent worker goes on serving
        # terminated the moment its pid is known: the default action already (a handler would lose it)
        other.start()
        other.terminate()
        other.join(10)
        assert other.exitcode == -signal.SIGTERM
        term_usr1 = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR1 - 1))
        late = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(30,))
        late.start()
        time.sleep(0.2)
        assert blocked_or_ignored(late.pid) & term_usr1 == 0  # neither blocked nor ignored once it runs
        late.terminate()
        late.join(10)
        assert late.exitcode == -signal.SIGTERM
        close_workers(loader)
        assert not process.is_alive() and process.exitcode == 0 and loader._iterator is None
    finally:  # a failure must not leave a worker that ignores SIGTERM for interpreter exit to join forever
        close_workers(loader, graceful=False)
        if other.pid is not None and other.is_alive():
            other.kill()
    assert os.path.exists(f"/proc/{server}")


@pytest.mark.timeout(60)
def test_a_loader_of_your_own_outside_fit_survives_the_preemption_signal_with_safe_worker_init(monkeypatch):
    """The README's recipe for a DataLoader outside fit: worker_init_fn=ddprun.safe_worker_init(your_fn).
    Its worker ignores the signal and runs the user's init; the same loader without it dies of the
    signal, as a rank's worker would under SLURM's signal to every process of the step."""
    import os
    import signal
    import time

    import ddprun
    from ddprun.preempt import PREEMPT

    monkeypatch.setattr(PREEMPT, "signals", (signal.SIGUSR1,))  # what ddprun run's bootstrap sets

    def loader(init):
        return DataLoader(Pids(), batch_size=4, num_workers=1, persistent_workers=True, worker_init_fn=init,
                          multiprocessing_context="fork")

    safe, plain = loader(ddprun.safe_worker_init(mark_worker)), loader(mark_worker)
    workers = [{int(b[0, 0]) for b in dl} for dl in (safe, plain)]
    assert all(len(w) == 1 and os.getpid() not in w for w in workers), workers
    os.kill(min(workers[0]), signal.SIGUSR1)
    time.sleep(0.2)
    batches = list(safe)
    assert {int(b[0, 0]) for b in batches} == workers[0]  # the same worker serves on
    assert all(int(b[0, 1]) for b in batches)  # the user's init ran there
    with pytest.raises(RuntimeError, match="killed by signal"):  # torch's SIGCHLD handler, or the next batch
        os.kill(min(workers[1]), signal.SIGUSR1)
        time.sleep(0.5)
        list(plain)


def test_safe_worker_init_outside_ddprun_run_is_the_users_own(monkeypatch):
    """No preemption signals (a plain python or torchrun process): nothing to ignore, the user's
    function (or None) is the worker_init_fn, unchanged."""
    import ddprun
    from ddprun.preempt import PREEMPT

    monkeypatch.setattr(PREEMPT, "signals", ())
    assert ddprun.safe_worker_init(mark_worker) is mark_worker
    assert ddprun.safe_worker_init() is None
