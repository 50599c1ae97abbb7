"""Cluster environments: each reads a mapping of environment variables and says what it sees.

The order in which they are tried lives in :mod:`ddprun.cluster.detect`.
"""

from ddprun.cluster.base import ClusterEnvironment, ClusterSpec, NodeFacts
from ddprun.cluster.detect import detect, resolve

__all__ = ["ClusterEnvironment", "ClusterSpec", "NodeFacts", "detect", "resolve"]
