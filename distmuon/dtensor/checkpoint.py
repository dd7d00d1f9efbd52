"""Checkpoints of DTensorMuon through torch.distributed.checkpoint, across meshes.

Part of DTensorMuon (distmuon/dtensor/), section 6 of its reading order.
"""

import torch.distributed as dist

# =============================================================================
# 6. Checkpoints through torch.distributed.checkpoint, across meshes
# =============================================================================
# The optimizer's state is sharded exactly as its parameter is (section 5): a
# momentum buffer or AdamW moment is a DTensor with the parameter's mesh and
# placements, on the ranks that hold the parameter, whoever owns the matrix.
# So torch.distributed.checkpoint (DCP) reshards it as it reshards the weights:
# each rank writes its local shards with their global offsets, and a load on
# another mesh (4 x 2 -> 2 x 2, -> 8 x 1, or into one process with plain
# tensors) reads, for each of its own shards, the overlapping pieces of the
# saved ones. The state dict is keyed by parameter name, never by position or
# owner, so a different assignment of owners on the new mesh changes nothing.
#
#   {"params": {name: parameter},
#    "optim":  {name: {"momentum_buffer"} or {"step", "exp_avg", "exp_avg_sq"}}}
#
# The checkpoint is torch's own recipe, as for AdamW under FSDP2: torch's
# get_optimizer_state_dict keys the state by fully qualified name (it maps the
# optimizer's params, group by group, to model.named_parameters()), and
# set_optimizer_state_dict gives the loaded state back through our
# load_state_dict. The optimizer's part is only to be an honest
# torch.optim.Optimizer: its params are the model's own parameters, its state
# exists from construction (so torch never runs its zero-gradient "init" step on
# it), and its load checks the whole state dict before torch replaces anything
# (distmuon.checks.checked_state_dict: names matched as these helpers match them,
# torch.compile's, activation checkpointing's and DDP's prefixes dropped), keeps
# the optimizer's own names and steps with the loaded options.
#
#   {"model": get_model_state_dict(model),                 each a DTensor (or plain) parameter
#    "optim": get_optimizer_state_dict(model, optimizer)}  {"state": {fqn: {"momentum_buffer"} or
#                                                           {"step", "exp_avg", "exp_avg_sq"}},
#                                                           "param_groups": [{"params": [fqn...], options}]}
#
# DCP loads in place: build the model and optimizer on the new mesh, take the
# same dict there as the target, dcp.load into it, then hand it to
# set_model_state_dict and set_optimizer_state_dict. process_group: the
# optimizer's (on a mesh smaller than the world, the other ranks would never
# join a collective of the whole world); None without a process group at all.

def checkpoint_state(model, optimizer):
    """torch's state dict of the model and its optimizer (live tensors: a DCP load writes into them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optim = get_optimizer_state_dict(model, optimizer)
    for group in optim["param_groups"]:  # the fqns in "params" name the parameters; param_names exist only where the
        group.pop("param_names", None)   # optimizer was given names, which may differ between a save and a load
    return {"model": get_model_state_dict(model), "optim": optim}


def save_checkpoint(path, model, optimizer):
    """dcp.save of checkpoint_state: nothing but torch's recipe (a thin wrapper for the demo and the tests)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state(model, optimizer), checkpoint_id=path, process_group=optimizer.axis.group)


def load_checkpoint(path, model, optimizer):
    """dcp.load into this rank's shards on whatever mesh the model now lives (or plain tensors, no process
    group), then torch's set_model_state_dict and set_optimizer_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = checkpoint_state(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=optimizer.axis.group, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])

