"""What `ddprun doctor` runs on every rank: nothing. The preflight in the worker bootstrap (with
DDPRUN_DOCTOR=1, rank 0 prints every node's facts and the checks) is the whole job."""
