"""The options the optimizers take, torch's own, and what they refuse: the constructor's checks.

Beside the lesson, no part of it, and below it: it imports no file of the project.
distributed_muon_cpu.py's DistributedMuon (and so section 7's optimizers) and distributed_muon_dtensor.py's
DTensorMuon take their param groups' options here and check their arguments here, and the command lines
check their flags with the same functions, so that a keyword and its flag are refused with the same words
(`name` spells an argument either way: a keyword, or mt.flag's "--lr"). The coefficients of section 1 are
the lesson's to read (check_ns_coefficients). Every check runs before anything moves: a refused optimizer
was never built, and a refused step changed nothing.

A param group of algorithm "muon" takes exactly torch.optim.Muon's options, one of "adamw" exactly
torch.optim.AdamW's, each with torch's default, read from the installed torch's signatures: a Muon group's
`eps` is Newton-Schulz's, an AdamW group's Adam's. Each is honoured bit for bit, or refused at any value but
torch's default, for the reason in REFUSED (tests/test_torch_options.py walks the signatures).
"""

from __future__ import annotations

import inspect
import math

import torch

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's, and None = "original"


def signature_options(optimizer_class):
    """{option: default} of a torch optimizer's constructor (every argument but params), from the installed torch."""
    return {name: p.default for name, p in inspect.signature(optimizer_class.__init__).parameters.items()
            if name not in ("self", "params")}


ALGORITHMS = {"muon": torch.optim.Muon, "adamw": torch.optim.AdamW}
TORCH_OPTIONS = {algorithm: signature_options(cls) for algorithm, cls in ALGORITHMS.items()}
# The options honoured bit for bit; any other option of torch's signatures is refused at any value but torch's
# default, with its reason (one a newer torch adds, with the last one, until it is honoured here).
HONOURED = {"muon": ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"),
            "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
REFUSED = {
    "foreach": "each rank steps its shards with torch's single-tensor AdamW, torch's own choice on the CPU; the "
               "multi-tensor kernels (foreach=True) are not implemented here",
    "fused": "each rank steps its shards with torch's single-tensor AdamW; the fused kernel is not implemented here",
    "capturable": "capturing the step in a CUDA graph is not implemented here",
    "differentiable": "differentiating through the step is not implemented here",
}
UNSET = (None, False)  # what torch's defaults of the refused options mean here: the single-tensor path, no graph


def class_name(algorithm):
    return f"torch.optim.{ALGORITHMS[algorithm].__name__}"


def refusal(algorithm, option):
    """Why `option` of `algorithm` is refused at any value but torch's default."""
    return REFUSED.get(option, f"{class_name(algorithm)}'s option {option} (in a newer torch than this project "
                               f"knows) is not implemented here")


def _number(name, key, value, low=0.0, high=math.inf, high_open=False, integer=False):
    """A real number (an int where `integer`; never a bool, a string or a tensor) in [low, high] (or [low, high))."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name(key)} must be {kind} (got {value!r}, a {type(value).__name__})")
    if not (low <= value and (value < high if high_open else value <= high) and math.isfinite(value)):
        interval = f"[{low:g}, {high:g}{')' if high_open else ']'}" if math.isfinite(high) else f">= {low:g} and finite"
        raise ValueError(f"{name(key)} must be {'in ' if math.isfinite(high) else ''}{interval} (got {value})")


def check_option(name, algorithm, key, value):
    """One option of `algorithm` by torch's rule, stricter where a value would break the step: finite numbers,
    momentum below 1 (torch takes any momentum >= 0; at 1 the buffer never takes a gradient), ns_steps below 100
    (torch's own limit, which it checks only inside the step). ns_coefficients: the lesson's check_ns_coefficients."""
    if key not in HONOURED[algorithm]:
        if value not in UNSET and value != TORCH_OPTIONS[algorithm][key]:
            raise ValueError(f"{name(key)}={value!r} is refused: {refusal(algorithm, key)}")
    elif key in ("lr", "weight_decay", "eps"):
        _number(name, key, value)
    elif key == "momentum":
        _number(name, key, value, high=1.0, high_open=True)
    elif key == "ns_steps":
        _number(name, key, value, low=1, high=100, high_open=True, integer=True)
    elif key in ("nesterov", "amsgrad", "maximize"):
        if not isinstance(value, bool):
            raise ValueError(f"{name(key)} must be True or False (got {value!r})")
    elif key == "adjust_lr_fn":
        if value is not None and value not in ADJUST_LR_FNS:
            raise ValueError(f"{name(key)} must be None or one of {', '.join(ADJUST_LR_FNS)} (got {value!r})")
    elif key == "betas":
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ValueError(f"{name(key)} must be two numbers in [0, 1) (got {value!r})")
        for beta in value:
            _number(name, key, beta, high=1.0, high_open=True)


def check_options(name, options, bucket_size=1):
    """Options given for every group that takes them (the constructor's keywords): each must be an option of
    torch.optim.Muon or torch.optim.AdamW, with a value both (or the one taking it) accept; and the
    optimizer's own bucket_size (elements, >= 1)."""
    _number(name, "bucket_size", bucket_size, low=1, integer=True)
    for key, value in options.items():
        takers = [a for a in ALGORITHMS if key in TORCH_OPTIONS[a]]
        if not takers:  # as Python refuses an unexpected keyword argument: a TypeError
            raise TypeError(f"unexpected keyword argument {name(key)!r}: not an option of torch.optim.Muon "
                            f"({', '.join(TORCH_OPTIONS['muon'])}) or torch.optim.AdamW "
                            f"({', '.join(TORCH_OPTIONS['adamw'])})")
        for algorithm in takers:
            check_option(name, algorithm, key, value)


def check_hyperparameters(name=str, *, bucket_size, lr, weight_decay, momentum, adjust_lr_fn):
    """The command lines' Muon flags, by the optimizers' rules (`name` spells an argument: a flag)."""
    check_options(name, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn=adjust_lr_fn),
                  bucket_size)


def check_adamw_hyperparameters(name=str, *, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's rules for these four (lr, eps, weight_decay >= 0; each beta in [0, 1)), finite."""
    for key, value in dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).items():
        check_option(name, "adamw", key, value)


def group_spelling(i, group):
    return lambda key: f"param group {i} ({group.get('algorithm', 'muon')}): {key}"


# The keys a param group may hold beside its options: torch's own, and what torch's LR schedulers add to it.
GROUP_KEYS = ("params", "param_names", "algorithm")
SCHEDULER_KEYS = ("initial_lr", "base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")


def check_param_group(group, i):
    """A group's options (once filled) by their algorithm's rules, naming the group: at construction, and at
    every step, where a value set or loaded since then is caught before anything moves."""
    name = group_spelling(i, group)
    for key in TORCH_OPTIONS[group["algorithm"]]:
        check_option(name, group["algorithm"], key, group[key])


def check_param_groups(param_groups):
    """Every group's options (once filled), each by its algorithm's rules."""
    for i, group in enumerate(param_groups):
        check_param_group(group, i)


def fill_param_group(group, options, i, extra=()):
    """The group as the optimizer keeps it, in place (torch's add_param_group fills its dict in place too): its
    algorithm ("muon" unless given, as torch.optim.Muon takes plain parameters), and each option of that
    algorithm from the group, else from `options` (the constructor's keywords), else torch's default. Refused
    in one line naming the group: a group with no parameters, an unknown algorithm, a key its algorithm's
    torch optimizer does not take (a Muon group's Newton-Schulz epsilon is torch's `eps`), a value torch (or
    the step) would not take. extra: further keys this optimizer takes in a group."""
    if not isinstance(group, dict):
        raise ValueError(f"param group {i} must be a dict with 'params' (got {type(group).__name__})")
    algorithm = group.setdefault("algorithm", "muon")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"param group {i}: algorithm must be 'muon' or 'adamw' (got {algorithm!r})")
    params = group.get("params")
    if params is not None and not torch.is_tensor(params):  # a generator (model.parameters()) is read once, here
        group["params"] = params = list(params)
    if params is None or (not torch.is_tensor(params) and not params):
        raise ValueError(f"param group {i} ({algorithm}) has no parameters")
    unknown = sorted(set(group) - set(GROUP_KEYS) - set(TORCH_OPTIONS[algorithm]) - set(extra))
    if unknown:
        raise ValueError(f"param group {i} ({algorithm}): {', '.join(unknown)}: not an option of {class_name(algorithm)}, "
                         f"which takes {', '.join(TORCH_OPTIONS[algorithm])}")
    for key, default in TORCH_OPTIONS[algorithm].items():
        group.setdefault(key, options.get(key, default))
    check_param_group(group, i)
    return group


def name_params(group, first):
    """Plain tensors of a group, named as torch's state_dict numbers them (their index in the optimizer, from
    `first`): every optimizer here keys its layout by name. Named parameters ((name, tensor) pairs, as
    named_parameters() gives them) are kept."""
    params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
    if params and all(torch.is_tensor(p) for p in params):
        params = [(str(first + k), p) for k, p in enumerate(params)]
    group["params"] = params
    return group


def named_params(param_groups):
    """[(name, tensor, its group)] after the checks every optimizer here needs (DTensorMuon's too):
    'muon' or 'adamw' groups, their options, named float32 parameters (state is keyed by name), no
    name or tensor twice."""
    for i, group in enumerate(param_groups):
        if group.get("algorithm") not in ALGORITHMS:
            raise ValueError(f"param group {i}: algorithm must be 'muon' or 'adamw' (got {group.get('algorithm')!r})")
        if "param_names" not in group:
            raise ValueError("pass named parameters: [(name, tensor), ...] (state is keyed by name)")
    check_param_groups(param_groups)
    named, seen, tensors = [], set(), {}
    for group in param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if name in seen:
                raise ValueError(f"parameter {name} appears twice")
            if id(p) in tensors:
                raise ValueError(f"parameters {tensors[id(p)]} and {name} are the same tensor: it would be stepped "
                                 f"twice")
            if p.dtype != torch.float32:
                raise ValueError(f"{name} is {p.dtype}; this reference keeps float32 parameters")
            seen.add(name)
            tensors[id(p)] = name
            named.append((name, p, group))
    return named


def not_a_matrix(name, shape, expert_stacks=False):
    """Why a parameter of a Muon group that is not 2-D is refused, and what to do instead (a 3-D one: name it an
    expert stack, where the optimizer takes expert_stacks)."""
    stack = ", or name it in expert_stacks (experts, out, in)" if expert_stacks and len(shape) == 3 else ""
    return (f"Muon needs 2-D parameters; {name} has shape {tuple(shape)}: put it in a group of algorithm 'adamw' "
            f"(muon_param_groups splits a model the way Muon users do){stack}")


def index_named_params(param_groups, tp_split_dims):
    """({name: tensor}, {name: its group}, {name: TP split dim}) after checking what the step relies on."""
    param_by_name, group_of = {}, {}
    for name, p, group in named_params(param_groups):
        if group["algorithm"] == "muon" and p.ndim != 2:
            raise ValueError(not_a_matrix(name, p.shape))
        if not p.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is viewed flat)")
        param_by_name[name], group_of[name] = p, group
    unknown = set(tp_split_dims) - set(param_by_name)
    if unknown:
        raise ValueError(f"tp_split_dims names unknown parameters: {sorted(unknown)}")
    split_dims = {name: tp_split_dims.get(name, -1) for name in param_by_name}
    for name, split in split_dims.items():
        if isinstance(split, bool) or not isinstance(split, int) or not -1 <= split < param_by_name[name].ndim:
            raise ValueError(f"tp_split_dim {split!r} of {name} is out of range for shape "
                             f"{tuple(param_by_name[name].shape)}")
    return param_by_name, group_of, split_dims


HEADS = ("lm_head", "head", "output")  # the module names an output head goes by, whose weight Muon users give AdamW


def muon_param_groups(model, *, adamw=HEADS, muon=()):
    """[a Muon group, an AdamW group] of `model`'s named parameters, split as Muon users split a model: the
    2-D weights of its nn.Linear modules to Muon; to AdamW everything else (embeddings, norms, biases,
    scalars) and the Linear modules named in `adamw` (by default the output head: a module named lm_head, head
    or output, at any depth; a weight tied to an embedding's goes with it). `muon`: parameter names to give to
    Muon whatever module they belong to (they must be 2-D). A group's own options can be added to its dict."""
    linear = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
              if isinstance(mod, torch.nn.Linear) and m.split(".")[-1] not in adamw}
    embedded = {id(mod.weight) for mod in model.modules() if isinstance(mod, torch.nn.Embedding)}
    unknown = set(muon) - {n for n, _ in model.named_parameters()}
    if unknown:
        raise ValueError(f"muon names no parameter of the model: {', '.join(sorted(unknown))}")
    groups = {"muon": [], "adamw": []}
    for name, p in model.named_parameters():
        to_muon = name in muon or (name in linear and p.ndim == 2 and id(p) not in embedded)
        groups["muon" if to_muon else "adamw"].append((name, p))
    return [dict(params=groups[a], algorithm=a) for a in ("muon", "adamw") if groups[a]]
