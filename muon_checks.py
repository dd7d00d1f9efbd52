"""What the optimizers refuse: the constructor's checks, and the index of named parameters it builds.

Beside the lesson, no part of it, and below it: it imports no file of the project.
distributed_muon_cpu.py's DistributedMuon (and so section 7's optimizers) and distributed_muon_dtensor.py's
DTensorMuon check their arguments here, and the command lines check their flags with the same functions,
so that a keyword and its flag are refused with the same words (`name` spells an argument either way: a
keyword, or mt.flag's "--lr"). The coefficients of section 1 are the lesson's to read (check_ns_coefficients).
Every check runs before anything moves: a refused optimizer was never built.
"""

from __future__ import annotations

import math

import torch


ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's, and None = "original"


def check_hyperparameters(name=str, *, bucket_size, lr, weight_decay, momentum, adjust_lr_fn):
    """torch.optim.Muon's rules (`name` spells an argument: a keyword, or a command-line flag),
    stricter where a value would break the step: finite lr and weight decay, momentum below 1
    (torch accepts any >= 0; at 1 the buffer never takes a gradient)."""
    if bucket_size < 1:
        raise ValueError(f"{name('bucket_size')} must be >= 1 (got {bucket_size})")
    if not (lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"{name('lr')} must be >= 0 and finite (got {lr})")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"{name('weight_decay')} must be >= 0 and finite (got {weight_decay})")
    if not 0 <= momentum < 1:
        raise ValueError(f"{name('momentum')} must be in [0, 1) (got {momentum})")
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"{name('adjust_lr_fn')} must be one of {', '.join(ADJUST_LR_FNS)} (got {adjust_lr_fn!r})")


def check_adamw_hyperparameters(name=str, *, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's rules (lr, eps, weight_decay >= 0; each beta in [0, 1)), finite as above."""
    for key, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name(key)} must be >= 0 and finite (got {value})")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"{name('betas')} must be two numbers in [0, 1) (got {tuple(betas)})")


def check_param_groups(param_groups):
    """Every group's hyperparameters by its algorithm's rules, naming the group when one is wrong
    (torch checks only the constructor's defaults; a group's own value would fail mid-step)."""
    for i, group in enumerate(param_groups):
        spell = lambda key, i=i: f"param group {i}: {key}"
        if group.get("algorithm") == "adamw":
            check_adamw_hyperparameters(spell, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                        weight_decay=group["weight_decay"])
        else:
            check_hyperparameters(spell, bucket_size=1, lr=group["lr"], weight_decay=group["weight_decay"],
                                  momentum=group["momentum"], adjust_lr_fn=group["adjust_lr_fn"])
            if not 1 <= group["ns_steps"] < 100:  # torch.optim.Muon's limit
                raise ValueError(f"{spell('ns_steps')} must be in [1, 100) (got {group['ns_steps']})")


def named_params(param_groups):
    """[(name, tensor, its group)] after the checks every optimizer here needs (DTensorMuon's too):
    'muon' or 'adamw' groups, their options, named float32 parameters (state is keyed by name), no
    name twice."""
    for group in param_groups:
        if group["algorithm"] not in ("muon", "adamw"):
            raise ValueError(f"unknown algorithm {group['algorithm']!r}; use 'muon' or 'adamw'")
        if "param_names" not in group:
            raise ValueError("pass named parameters: [(name, tensor), ...] (state is keyed by name)")
    check_param_groups(param_groups)
    named, seen = [], set()
    for group in param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if name in seen:
                raise ValueError(f"parameter {name} appears twice")
            if p.dtype != torch.float32:
                raise ValueError(f"{name} is {p.dtype}; this reference keeps float32 parameters")
            seen.add(name)
            named.append((name, p, group))
    return named


def index_named_params(param_groups, tp_split_dims):
    """({name: tensor}, {name: its group}, {name: TP split dim}) after checking what the step relies on."""
    param_by_name, group_of = {}, {}
    for name, p, group in named_params(param_groups):
        if group["algorithm"] == "muon" and p.ndim != 2:
            raise ValueError(f"Muon needs 2-D parameters; {name} has shape {tuple(p.shape)}")
        if not p.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is viewed flat)")
        param_by_name[name], group_of[name] = p, group
    unknown = set(tp_split_dims) - set(param_by_name)
    if unknown:
        raise ValueError(f"tp_split_dims names unknown parameters: {sorted(unknown)}")
    split_dims = {name: tp_split_dims.get(name, -1) for name in param_by_name}
    for name, split in split_dims.items():
        if split >= param_by_name[name].ndim:
            raise ValueError(f"tp_split_dim {split} of {name} is out of range for shape "
                             f"{tuple(param_by_name[name].shape)}")
    return param_by_name, group_of, split_dims
