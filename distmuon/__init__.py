"""distmuon: distributed Muon for ZeRO-1 x TP and for FSDP2 x TP x EP, bit for bit torch.optim.Muon's.

    pip install .            # (or pip install git+<this repository's URL>)

    from distmuon import DTensorMuon, muon_param_groups       # FSDP2 (fully_shard) x TP (parallelize_module) x EP
    opt = DTensorMuon(muon_param_groups(model), lr=0.02)      # any torch.optim.Muon / AdamW option, per group

    from distmuon import OwnerMuon, make_grid                 # ZeRO-1 x TP, on your own process groups
    opt = OwnerMuon(groups, grid=make_grid(dp, tp, rank), tp_split_dims={...}, lr=0.02)

What each name is, and where it lives (the lesson, distributed_muon_cpu.py, is the core: sections 1-6):
    DistributedMuon, make_grid     the gather strategy, the DP x TP grid (distributed_muon_cpu.py, sections 2-5)
    OwnerMuon, CommFreeMuon        each matrix orthogonalized once, on one owner (distmuon/owners.py, section 7)
    LargeRuns, RowLayout           fused QKV by blocks, Newton-Schulz on TP pieces, QK-clip (distmuon/large_runs.py)
    DTensorMuon, DistributedConfig, save_checkpoint, load_checkpoint    FSDP2 x TP x EP (distmuon/dtensor/)
    muon_param_groups              a model split the way Muon users split it (distmuon/checks.py)
Names load on first use, so that the lesson, which imports distmuon's lower modules (checks, adamw,
collectives), and the modules above it (owners, large_runs, dtensor), which import the lesson, never meet in
a cycle.
"""

import importlib

WHERE = {
    "DistributedMuon": "distributed_muon_cpu", "make_grid": "distributed_muon_cpu",
    "OwnerMuon": "distmuon.owners", "CommFreeMuon": "distmuon.owners",
    "LargeRuns": "distmuon.large_runs", "RowLayout": "distmuon.large_runs",
    "DTensorMuon": "distmuon.dtensor", "DistributedConfig": "distmuon.dtensor",
    "save_checkpoint": "distmuon.dtensor", "load_checkpoint": "distmuon.dtensor",
    "muon_param_groups": "distmuon.checks",
}
__all__ = sorted(WHERE)


def __getattr__(name):
    if name not in WHERE:
        raise AttributeError(f"module 'distmuon' has no attribute {name!r}")
    return getattr(importlib.import_module(WHERE[name]), name)


def __dir__():
    return __all__
