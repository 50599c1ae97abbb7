"""What ``ddprun --help`` and ``ddprun COMMAND --help`` say: written for users, one place to edit.

HELP: the one line each subcommand gets in ``ddprun --help``. EPILOGS: its examples, shown verbatim
(argparse.RawDescriptionHelpFormatter). Every ``ddprun ...`` line in an epilog must parse
(tests/unit/test_help.py parses them all).
"""

from __future__ import annotations

DESCRIPTION = """\
Multi-node PyTorch DDP on torch's elastic launcher. `ddprun run` takes torchrun's flags, starts one
process per GPU on every node, detects SLURM, MPI, LSF, SkyPilot, SageMaker and Kubernetes, prints
the rank table it got, and names a failed or hung rank on every node within seconds."""

HELP = {
    "run": "launch a training script on this node (torchrun's flags)",
    "plan": "dry run: the rank table a launch would give, and why",
    "doctor": "check every node (GPUs, versions, addresses) without training",
    "report": "(re)write a run's report.html, or compare two runs",
    "slurm-template": "print a ready-to-submit sbatch script",
    "demo": "train a small model on 2 simulated nodes x 2 processes",
}

TOP_EPILOG = """\
examples:
  ddprun run --nnodes 5 --rdzv-id job1 --rdzv-endpoint node1:29500 train.py   # on each of 5 nodes
  srun --ntasks-per-node=1 ddprun run train.py                                 # SLURM: nothing to give
  ddprun run train.py                                                          # SageMaker entry point
  ddprun plan --nnodes 5 --nproc-per-node 4                                    # dry run, starts nothing
  ddprun demo                                                                  # see it work here

`ddprun COMMAND --help` shows each command's flags and examples."""

EPILOGS = {
    "run": """\
examples:
  # 5 nodes x 4 GPUs: the same line on every node (torchrun's flags; --nproc-per-node defaults to every GPU)
  ddprun run --nnodes 5 --nproc-per-node 4 --rdzv-id job1 --rdzv-endpoint node1:29500 train.py --lr 0.1

  # SLURM: one `ddprun run` per node; nodes, ranks, rendezvous and GPUs come from SLURM
  srun --ntasks-per-node=1 ddprun run train.py
  ddprun slurm-template --nodes 5 --gpus-per-node 4 train.py > job.sbatch   # a ready sbatch script

  # SageMaker: make the entry point run this once per host (SM_HOSTS, SM_CURRENT_HOST, SM_NUM_GPUS are read)
  ddprun run train.py

  # LSF: the job script runs on the first host only; blaunch starts one `ddprun run` on every host
  blaunch -z "$(echo $LSB_MCPU_HOSTS | awk '{for (i = 1; i <= NF; i += 2) printf "%s ", $i}')" ddprun run train.py

  # one machine, every GPU
  ddprun run --standalone train.py

  # a module instead of a script, with tracebacks of local ranks 0 and 1 on the console too
  ddprun run --tee 0:3,1:3 -m mypkg.train --epochs 3""",
    "plan": """\
examples:
  ddprun plan --nnodes 5 --nproc-per-node 4                  # the 20-row table; the endpoint shows as unresolved
  ddprun plan --nnodes 5 --nproc-per-node 4 --rdzv-endpoint node1:29500 --json   # for scripts (docs/plan-json.md)
  ddprun plan --explain                       # inside a SLURM/LSF/SkyPilot job: where each number came from""",
    "doctor": """\
examples:
  # on every node, with the flags you would give `ddprun run`
  ddprun doctor --nnodes 2 --rdzv-id check1 --rdzv-endpoint node1:29500
  srun --ntasks-per-node=1 ddprun doctor     # SLURM""",
    "report": """\
examples:
  ddprun report runs/job1                           # writes runs/job1/report.html
  ddprun report runs/job1 --compare runs/job0 -o compare.html""",
    "slurm-template": """\
examples:
  ddprun slurm-template --nodes 5 --gpus-per-node 4 --partition gpu train.py --lr 0.1 > job.sbatch
  sbatch job.sbatch""",
    "demo": """\
examples:
  ddprun demo                    # 2 nodes x 2 processes, gloo, about 15 s
  ddprun demo --nnodes 3 --nproc-per-node 1 --steps 50""",
}
