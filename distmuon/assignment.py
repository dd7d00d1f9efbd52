"""Who owns what: longest-processing-time over Newton-Schulz FLOPs (section 7.1 of the lesson).

Every strategy that orthogonalizes a matrix once gives it one owner rank, the same on every rank without talking:
the lesson's owner and comm-free strategies (distmuon/owners.py, over all DP x TP ranks) and DTensorMuon (its
plan, over the ranks that hold a piece of the matrix). One rule for both, here.
"""

from __future__ import annotations


def lpt_order(ns_flops, shapes=None):
    """The order in which assign_owners hands out matrices: decreasing FLOPs; among equal
    FLOPs, one shape after another (shapes: {name: shape}; in order of first appearance);
    within a shape, the order given, reversed for every other group.

    Why group by shape: equal FLOPs need not mean equal time (a tall matrix works on a
    transposed view: notes/measured/ns_shapes_2core.txt). Taken in model order (fc, fc2,
    fc, fc2, ...) on 2 ranks, LPT gave every fc to rank 0 and every fc2 to rank 1; taken
    shape by shape, the ranks get the same number of each, whatever each costs on the
    machine at hand. Why reverse every other group (a snake, as in a draft): taken all
    forward, rank 0 got every matrix of layers 0 and 2; a step overlapped unit by unit
    (below) then has the ranks take turns instead of working at the same time.
    """
    shape = {n: tuple(shapes[n]) if shapes else () for n in ns_flops}
    first, groups = {}, {}
    for name in ns_flops:
        first.setdefault(shape[name], len(first))
        groups.setdefault((ns_flops[name], shape[name]), []).append(name)
    order = []
    for i, key in enumerate(sorted(groups, key=lambda k: (-k[0], first[k[1]]))):
        order += groups[key] if i % 2 == 0 else groups[key][::-1]
    return order


def assign_owners(ns_flops, n_ranks, shapes=None, kept=None, holders=None, load=None):
    """Greedy longest-processing-time: {matrix name: rank}, balanced by Newton-Schulz FLOPs.

    Matrices in lpt_order, each to the rank with the least work so far (ties: the
    lowest rank). Deterministic, so every rank computes the same assignment without
    talking. LPT is within 4/3 of the best possible maximum (Graham, 1969); it cannot
    balance fewer or very uneven matrices (e.g. 10 matrices, 4 of them the largest,
    on 8 ranks). kept: {name: rank} of matrices already owned (a param group added to a
    built optimizer: the others keep their owners, and their work counts). holders:
    {name: the ranks it may go to} (None: any; DTensorMuon's, the ranks that hold a
    piece); load: each rank's work before these (None: none).
    """
    kept = {n: r for n, r in (kept or {}).items() if n in ns_flops}
    load = [0] * n_ranks if load is None else list(load)
    for name, rank in kept.items():
        load[rank] += ns_flops[name]
    owners = dict(kept)
    for name in lpt_order({n: f for n, f in ns_flops.items() if n not in kept}, shapes):
        rank = min(range(n_ranks) if holders is None else holders[name], key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += ns_flops[name]
    return {n: owners[n] for n in ns_flops}


def check_owners(owned_by_rank, matrices, n_ranks):
    """{rank: [names]} -> {name: rank}; ValueError naming each missing, doubled or unknown matrix."""
    owners, problems = {}, []
    for rank, names in sorted(owned_by_rank.items()):
        if not (isinstance(rank, int) and 0 <= rank < n_ranks):
            problems.append(f"rank {rank!r} is not in [0, {n_ranks})")
        for name in names:
            if name in owners:
                problems.append(f"{name} is owned twice (ranks {owners[name]} and {rank})")
            elif name not in matrices:
                problems.append(f"{name} is not a Muon matrix")
            owners.setdefault(name, rank)
    problems += [f"{name} has no owner" for name in matrices if name not in owners]
    if problems:
        raise ValueError("bad owner assignment: " + "; ".join(problems))
    return {n: owners[n] for n in matrices}


def load_balance(ns_flops, owners, n_ranks):
    """FLOPs per rank under `owners`, and max/mean (1.00 is perfect balance)."""
    per_rank = [0] * n_ranks
    for name, rank in owners.items():
        per_rank[rank] += ns_flops[name]
    return per_rank, max(per_rank) / (sum(per_rank) / n_ranks)
