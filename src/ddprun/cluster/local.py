"""The fallback: one machine, nothing but this node's own facts."""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading


class LocalEnvironment(ClusterEnvironment):
    name = "local"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        return {
            "min_nodes": Fact(1, "default: one node"),
            "max_nodes": Fact(1, "default: one node"),
        }
