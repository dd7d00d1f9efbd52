"""One LPT: distmuon.owners.assign_owners, with holders and a starting load, is DTensorMuon's assignment among the
holders of each matrix (distmuon.dtensor.plan.assign_among_holders), owner for owner, so that one can call the other."""

import random

from conftest import mo
from distmuon.dtensor.plan import assign_among_holders


def test_assign_owners_with_holders_is_the_assignment_among_holders():
    rng = random.Random(0)
    for case in range(200):
        world = rng.randint(1, 8)
        names = [f"w{i}" for i in range(rng.randint(1, 12))]
        shapes = {n: (rng.choice([4, 8, 16]), rng.choice([4, 8])) for n in names}
        flops = {n: mo.newton_schulz_flops(shapes[n]) for n in names}
        holders = {n: sorted(rng.sample(range(world), rng.randint(1, world))) for n in names}
        load = [rng.choice([0, 10**5, 10**6]) for _ in range(world)] if case % 2 else None
        ours = mo.assign_owners(flops, world, shapes, holders=holders, load=load)
        assert ours == assign_among_holders(flops, holders, world, load, shapes), case
        assert all(ours[n] in holders[n] for n in names)
    # without holders or load, as before: any rank, from no work
    flops = {"a": 8, "b": 8, "c": 4, "d": 2}
    assert mo.assign_owners(flops, 2) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert mo.assign_owners(flops, 2, holders={n: [1] for n in flops}) == {n: 1 for n in flops}
    assert mo.assign_owners(flops, 2, load=[100, 0]) == {"a": 1, "b": 1, "c": 1, "d": 1}
