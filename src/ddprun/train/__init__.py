"""Training a plain ``nn.Module`` data-parallel: :func:`fit` and its parts.

loop.py (the loop) · data.py (samplers, DataLoader defaults) · checkpoint.py (atomic save/load) ·
metrics.py (metrics.csv) · progress.py (rank 0's progress bar or lines).
"""

from ddprun.train.loop import FitResult, fit

__all__ = ["FitResult", "fit"]
