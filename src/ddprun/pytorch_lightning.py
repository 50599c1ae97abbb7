"""ddprun.lightning for the standalone ``pytorch_lightning`` package (``pip install 'ddprun[pytorch-lightning]'``).

The same API as :mod:`ddprun.lightning` — ``trainer_kwargs()``, ``fit_lightning()``,
``DdprunEnvironment``, ``LaunchCheck`` — built on ``pytorch_lightning`` instead of
``lightning.pytorch``. The two packages have the same code under different names, but their classes
are distinct: a ``pytorch_lightning.LightningModule`` needs a ``pytorch_lightning.Trainer`` and its
callbacks, strategies and environments. So this module runs ddprun.lightning's source with
``PACKAGE = "pytorch_lightning"`` (as Lightning itself generates pytorch_lightning from
lightning.pytorch), and works with or without the ``lightning`` package installed.
"""

from importlib.util import find_spec as _find_spec

PACKAGE = "pytorch_lightning"

_doc = __doc__
_spec = _find_spec("ddprun.lightning")
if _spec is None or _spec.origin is None:  # never: it is part of this package; says so if it is gone
    raise ImportError("ddprun.pytorch_lightning needs ddprun/lightning.py, which is missing")
_source = _spec.origin
with open(_source, encoding="utf-8") as _f:
    # the classes defined below get __module__ "ddprun.pytorch_lightning", so they pickle by this name
    exec(compile(_f.read(), _source, "exec"), globals())  # noqa: S102 - ddprun's own source
__doc__ = _doc  # the exec set ddprun.lightning's
del _f, _spec, _source, _doc
