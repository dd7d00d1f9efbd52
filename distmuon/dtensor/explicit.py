"""DTensorMuon with your own distributed_config (section 4): your gather, Newton-Schulz on the owners, your
redistribute.

Part of DTensorMuon (distmuon/dtensor/): where distributed_config has gather and redistribute, this takes the place
of the owner exchange (exchange.py) whole, with its interface: plan() finds the owners (your assign, or the lesson's
longest-processing-time over Newton-Schulz FLOPs), start() and finish() run stage 3 of a step through your callables,
their results checked and voted on (a refused step changes nothing: DTensorMuon keeps the new momentum aside until
they pass).
"""

from __future__ import annotations

from distmuon import owners
from distmuon.checks import ORTHOGONALIZED
from distributed_muon_cpu import newton_schulz_flops


class ExplicitExchange:
    """Who orthogonalizes which matrix, and your callables that take it there and back. After plan(): ns_flops and
    owners ({matrix: FLOPs, owner rank}); matrices, local_matrices, index and param_of_matrix empty (the placements
    are yours: the plan knows none)."""

    def __init__(self, config, batched_ns=False):
        self.config, self.batched_ns = config, batched_ns

    def plan(self, opt, copies):
        muon = [n for n in opt.param_by_name if opt.group_of[n]["algorithm"] in ORTHOGONALIZED]
        self.ns_flops = {n: newton_schulz_flops(self.config.global_shapes[n], opt.group_of[n]["ns_steps"])
                         for n in muon}
        ranks = opt.axis.ranks
        owned = (self.config.assign(self.ns_flops, {n: ranks for n in muon}, opt.world)
                 if self.config.assign is not None
                 else {r: [n for n, o in owners.assign_owners(self.ns_flops, len(ranks),
                                                              self.config.global_shapes).items() if ranks[o] == r]
                       for r in ranks})
        self.owners = owners.check_owners(owned, muon, opt.world)
        strangers = sorted(n for n, r in self.owners.items() if r not in ranks)
        if strangers:
            raise ValueError(f"bad owner assignment: owned outside the optimizer's group: {', '.join(strangers)}")
        self.matrices, self.local_matrices, self.index, self.param_of_matrix = [], {}, {}, {}

    def start(self, opt, updates, exchanged=True):
        """Nothing starts before your gather: the updates, for finish()."""
        return updates

    def finish(self, opt, updates, exchanged=True, rows=True):
        """{name: bf16 update of this rank's local piece} -> a function that returns {name: its orthogonalized local
        piece}: your gather, Newton-Schulz on the owners, your redistribute; shapes checked on the way, and voted
        on."""
        orthogonal = self.orthogonalize(opt, updates)
        return lambda: orthogonal

    def orthogonalize(self, opt, updates):
        full = self.config.gather(dict(updates), dict(self.owners))
        wrong = [f"gather gave {n} as {tuple(full[n].shape) if n in full else None}, expected "
                 f"{tuple(self.config.global_shapes[n])}" for n in updates if self.owners[n] == opt.me
                 and (n not in full or tuple(full[n].shape) != tuple(self.config.global_shapes[n]))]
        opt.refuse_on_every_rank(wrong[0] if wrong else None, "explicit checks")
        orthogonal = owners.newton_schulz_owned({n: full[n] for n in updates if self.owners[n] == opt.me},
                                                opt.group_of, opt.ledger, self.batched_ns)
        local = self.config.redistribute(orthogonal, dict(self.owners))
        wrong = [f"redistribute gave no piece of {n} the size of this rank's parameter" for n in updates
                 if n not in local or local[n].numel() != updates[n].numel()]
        opt.refuse_on_every_rank(wrong[0] if wrong else None, "explicit checks")
        return {n: local[n] for n in updates}
