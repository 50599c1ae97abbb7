"""ddprun: multi-node PyTorch DDP that starts everywhere, uses every GPU, and names what is wrong.

Importing ddprun is cheap: it imports neither torch's distributed stack eagerly nor lightning.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
