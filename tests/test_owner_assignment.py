"""One LPT: distmuon.owners.assign_owners, with holders and a starting load (DTensorMuon's plan calls it so), gives
each matrix, in lpt_order, to the least loaded of its holders (ties: the lowest rank), owner for owner."""

import random

from distmuon import owners


def test_assign_owners_with_holders_gives_each_matrix_its_least_loaded_holder():
    rng = random.Random(0)
    for case in range(200):
        world = rng.randint(1, 8)
        names = [f"w{i}" for i in range(rng.randint(1, 12))]
        shapes = {n: (rng.choice([4, 8, 16]), rng.choice([4, 8])) for n in names}
        flops = {n: owners.newton_schulz_flops(shapes[n]) for n in names}
        holders = {n: sorted(rng.sample(range(world), rng.randint(1, world))) for n in names}
        load = [rng.choice([0, 10**5, 10**6]) for _ in range(world)] if case % 2 else None
        ours = owners.assign_owners(flops, world, shapes, holders=holders, load=load)
        work = list(load or [0] * world)  # the rule replayed, matrix by matrix
        for name in owners.lpt_order(flops, shapes):
            least = min(work[r] for r in holders[name])
            assert ours[name] == min(r for r in holders[name] if work[r] == least), (case, name)
            work[ours[name]] += flops[name]
        assert all(ours[n] in holders[n] for n in names)
    # without holders or load, as before: any rank, from no work
    flops = {"a": 8, "b": 8, "c": 4, "d": 2}
    assert owners.assign_owners(flops, 2) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert owners.assign_owners(flops, 2, holders={n: [1] for n in flops}) == {n: 1 for n in flops}
    assert owners.assign_owners(flops, 2, load=[100, 0]) == {"a": 1, "b": 1, "c": 1, "d": 1}
