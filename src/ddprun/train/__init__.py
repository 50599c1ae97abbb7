"""Training a plain ``nn.Module`` data-parallel: :func:`fit_module` and its parts.

options.py (FitOptions: fit's arguments, checked) · loop.py (setup, epochs, step, finish) · data.py
(samplers, DataLoader defaults) · checkpoint.py (atomic save/load) · resume.py (which checkpoint a
run continues from) · metrics.py (metrics.csv) · progress.py (rank 0's progress bar or lines).
``ddprun.fit`` (:mod:`ddprun.api`) sends a LightningModule elsewhere; nothing here imports lightning.
"""

from ddprun.train.loop import CheckpointSaved, FitResult, fit_module
from ddprun.train.options import FitOptions

__all__ = ["CheckpointSaved", "FitOptions", "FitResult", "fit_module"]
