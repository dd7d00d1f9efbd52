"""Two rules the lesson's optimizers (DistributedMuon and its strategies) and DTensorMuon share, each written once: a
param group added whole or not at all, and a deep copy that steps as the original does."""

import copy

from distmuon.checks import fill_param_group, name_params


def add_or_refuse_group(optimizer, param_group, torch_add, options, relayout=None, prepare=None, restore=None,
                        check=None):
    """torch's add_param_group, the distributed way: a group that is not a dict refused; prepare(group) (the
    optimizer's own keys taken out of it); its options filled and checked per its algorithm over `options` (the
    constructor's keywords: fill_param_group); check(group) (the optimizer's own refusals of the filled group, before
    its parameters are named); its parameters named (name_params) and the group added by torch_add
    (torch.optim.Optimizer.add_param_group, bound), torch's defaults kept off it (the group is filled per its
    algorithm, not from optimizer.defaults); then relayout() (None at construction: the first groups are laid out
    together after it). Refused (ValueError, TypeError), nothing changed: the param groups, and each attribute of
    `restore` ({name: its value before}), put back, the layout made again, and the error raised."""
    before = list(optimizer.param_groups)
    try:
        if not isinstance(param_group, dict):
            raise ValueError(f"a param group must be a dict with 'params' (got {type(param_group).__name__})")
        if prepare is not None:
            prepare(param_group)
        fill_param_group(param_group, options, len(optimizer.param_groups))
        if check is not None:
            check(param_group)
        defaults, optimizer.defaults = optimizer.defaults, {}
        try:
            torch_add(name_params(param_group, sum(len(g["params"]) for g in optimizer.param_groups)))
        finally:
            optimizer.defaults = defaults
        if relayout is not None:
            relayout()
    except (ValueError, TypeError):
        optimizer.param_groups[:] = before
        for name, value in (restore or {}).items():
            setattr(optimizer, name, value)
        if relayout is not None:
            relayout()
        raise


def copy_sharing(optimizer, memo, shared):
    """copy.deepcopy of a distributed optimizer (torch's Optimizer copies only defaults, state and param_groups, so
    its copy could not step): every attribute, parameters and state copied, the objects in `shared` (its process
    groups, device meshes: what ties it to its ranks) the same objects, so the copy steps on the same ranks."""
    memo.update({id(x): x for x in shared if x is not None})
    copied = memo[id(optimizer)] = type(optimizer).__new__(type(optimizer))
    copied.__dict__.update(copy.deepcopy(optimizer.__dict__, memo))
    return copied
