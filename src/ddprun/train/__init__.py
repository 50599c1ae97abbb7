"""Training a plain ``nn.Module`` data-parallel: :func:`fit_module` and its parts.

loop.py (the loop) · data.py (samplers, DataLoader defaults) · checkpoint.py (atomic save/load) ·
resume.py (which checkpoint a run continues from) · metrics.py (metrics.csv) · progress.py (rank 0's progress bar or lines).
``ddprun.fit`` (:mod:`ddprun.api`) sends a LightningModule elsewhere; nothing here imports lightning.
"""

from ddprun.train.loop import CheckpointSaved, FitResult, fit_module

__all__ = ["CheckpointSaved", "FitResult", "fit_module"]
