"""DTensorMuon's distributed_config: automatic from the placements, or your own callables.

Part of DTensorMuon (distmuon/dtensor/), section 4 of its reading order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# =============================================================================
# 4. The configuration: automatic from placements, or your own callables
# =============================================================================
# PyTorch's design discussion for a distributed torch.optim.Muon proposes a
# `distributed_config` with three callables: who orthogonalizes what (assign),
# how a matrix is put together on its owner (gather), and how the result goes
# back (redistribute). Here the same three, with our names:
#
#   DistributedConfig()                          automatic: everything from the DTensor placements
#   DistributedConfig(assign=f)                  automatic data path, your owners:
#                                                f(ns_flops, holders, world) -> {rank: [matrix names]}
#   DistributedConfig(gather=g, redistribute=r,  your own parallelism (plain tensors you sharded yourself):
#                     global_shapes={...},         g(updates, owners) -> {name: full matrix} (the ones you own),
#                     assign=f or None)            r(orthos, owners) -> {name: your local piece},
#                                                f as above; holders: every rank of the optimizer's group
#                                                (None: the lesson's LPT)
#
# One `assign` signature in both forms: f(ns_flops, holders, world), where
# ns_flops is {matrix name: Newton-Schulz FLOPs}, holders {matrix name: (global
# ranks that may own it)}, world the world size; it returns {rank: [names]}.
#
# Every assignment is checked at construction: each matrix owned exactly once
# (the lesson's check_owners names each missing, doubled or unknown one), and,
# in the automatic form, by a rank that holds some of it.

@dataclass(frozen=True)
class DistributedConfig:
    """Who orthogonalizes what, and (explicit form) how matrices travel; see section 4 of the file.

    assign: f(ns_flops, holders, world) -> {global rank: [matrix names]}, in both forms; None:
        longest-processing-time over Newton-Schulz FLOPs, each matrix among its holders.
    gather, redistribute, global_shapes: the explicit form, all three or none (see above).
    """

    assign: Callable | None = None
    gather: Callable | None = None
    redistribute: Callable | None = None
    global_shapes: dict | None = None  # explicit form only: {name: (rows, cols)} of each Muon matrix

    @property
    def explicit(self):
        return self.gather is not None or self.redistribute is not None

    def check(self):
        if self.explicit and (self.gather is None or self.redistribute is None or self.global_shapes is None):
            raise ValueError("an explicit distributed_config needs gather, redistribute and global_shapes together")
        if not self.explicit and self.global_shapes is not None:
            raise ValueError("global_shapes belongs to an explicit distributed_config (with gather and redistribute)")

