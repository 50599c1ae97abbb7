"""One job per endpoint, on a real TCPStore."""

from torch.distributed import TCPStore

from ddprun.protocol.store import OWNER_KEY, claim, refusal


def test_first_claim_wins_and_others_are_refused():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert claim(store, "jobA", "secret") is None
    assert claim(store, "jobA", "secret") is None  # the same job again (another node)
    assert claim(store, "jobB", "secret") == "jobA"
    assert claim(store, "jobA", "other-secret") == "jobA"  # same id, different token
    assert b"secret" not in store.get(OWNER_KEY)  # only a digest is kept


def test_refusal_names_both_jobs_and_the_fix():
    msg = refusal("h:1", "jobA", "jobB")
    assert "run id 'jobA'; this one is 'jobB'" in msg and "HINT" in msg
    assert "same run id 'jobA' but a different DDPRUN_JOB_TOKEN" in refusal("h:1", "jobA", "jobA")
