"""The options the optimizers take, torch's own, and what they refuse: the constructors' and the step's checks.

Part of the library (distmuon), below the lesson: it imports no other file of the project, and the lesson
(distributed_muon_cpu.py), its strategies (distmuon/owners.py) and DTensorMuon (distmuon/dtensor/) check their
arguments here, as the runner's command lines check their flags, so that a keyword and its flag are refused
with the same words (`name` spells an argument either way: a keyword, or the runner's "--lr"). Every check runs
before anything moves: a refused optimizer was never built, a refused add_param_group left the optimizer as it
was, a refused step changed nothing, and a refused load replaced nothing (checked_state_dict, at the end: a state
dict matched to the parameters by name as torch's checkpoint helpers match them, and checked whole).

A param group of algorithm "muon" takes exactly torch.optim.Muon's options, one of "adamw" exactly
torch.optim.AdamW's, each with torch's default, read from the installed torch's signatures: a Muon group's
`eps` is Newton-Schulz's, an AdamW group's Adam's. Each is honoured bit for bit, or refused at any value but
torch's default, for the reason in REFUSED (tests/test_torch_options.py walks the signatures). One Muon option
takes more than torch's one (a, b, c): ns_coefficients may give one triple per Newton-Schulz iteration, or name
a set of them (NS_COEFFICIENT_CHOICES: Jordan's, torch's default, or Polar Express's).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch.distributed.tensor import DTensor

from distmuon.normuon import NORMUON_OPTIONS
from distmuon.strategy import Strategy

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")  # torch.optim.Muon's, and None = "original"


def signature_options(optimizer_class):
    """{option: default} of a torch optimizer's constructor (every argument but params), from the installed torch."""
    return {name: p.default for name, p in inspect.signature(optimizer_class.__init__).parameters.items()
            if name not in ("self", "params")}


ALGORITHMS = {"muon": torch.optim.Muon, "adamw": torch.optim.AdamW}
TORCH_OPTIONS = {algorithm: signature_options(cls) for algorithm, cls in ALGORITHMS.items()}
# The algorithms a param group may name: torch's two, and NorMuon (distmuon/normuon.py), which takes torch.optim.Muon's
# options and two of its own. Muon and NorMuon orthogonalize: their parameters are matrices.
OPTIONS = dict(TORCH_OPTIONS, normuon=dict(TORCH_OPTIONS["muon"], **NORMUON_OPTIONS))
ORTHOGONALIZED = ("muon", "normuon")
# Newton-Schulz's coefficients: one (a, b, c) for every iteration (Keller Jordan's, torch.optim.Muon's default), or
# one per iteration. Polar Express (Amsel et al., arXiv 2505.16932, Algorithm 1) picks each iteration's polynomial
# to be optimal for the worst singular value the previous ones left: its eight triples, the first seven divided by
# (1.01, 1.01^3, 1.01^5), its safety factor for bf16; iterations past the eighth repeat the last. (Its extra 1.01 on
# the norm is not applied: the normalization stays torch.optim.Muon's.)
JORDAN = TORCH_OPTIONS["muon"]["ns_coefficients"]
_POLAR_EXPRESS = ((8.28721201814563, -23.595886519098837, 17.300387312530933),
                  (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
                  (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
                  (3.3184196573706015, -2.488488024314874, 0.51004894012372),
                  (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
                  (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
                  (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
                  (1.875, -1.25, 0.375))
POLAR_EXPRESS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS[:-1]) + _POLAR_EXPRESS[-1:]
NS_COEFFICIENT_CHOICES = {"jordan": JORDAN, "polar_express": POLAR_EXPRESS}


def ns_coefficients_of(coefficients, steps):
    """One (a, b, c) triple per iteration, as a tuple of `steps` triples: from one triple (every iteration), a
    list of exactly `steps` triples, or a name of NS_COEFFICIENT_CHOICES (a longer list gives its first `steps`, a
    shorter one repeats its last, as Algorithm 1 does). A ValueError says what else it got."""
    if isinstance(coefficients, str):
        if coefficients not in NS_COEFFICIENT_CHOICES:
            raise ValueError(f"ns_coefficients {coefficients!r} is not one of {', '.join(NS_COEFFICIENT_CHOICES)}")
        named = NS_COEFFICIENT_CHOICES[coefficients]
        named = (named,) if isinstance(named[0], (int, float)) else named
        return tuple(named[min(i, len(named) - 1)] for i in range(steps))
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if not isinstance(coefficients, (tuple, list)):
        raise ValueError(f"ns_coefficients must be one (a, b, c) triple, a name ({', '.join(NS_COEFFICIENT_CHOICES)}) "
                         f"or {steps} triples, one per iteration (got {coefficients!r}, a {type(coefficients).__name__})")
    coefficients = tuple(coefficients)
    if len(coefficients) == 3 and all(number(v) for v in coefficients):
        triples = (tuple(float(v) for v in coefficients),) * steps
    else:
        triples = tuple(tuple(float(v) for v in t) if isinstance(t, (tuple, list)) and len(t) == 3
                        and all(number(v) for v in t) else None for t in coefficients)
        if None in triples or len(triples) != steps:
            raise ValueError(f"ns_coefficients must be one (a, b, c) triple, a name ({', '.join(NS_COEFFICIENT_CHOICES)}) "
                             f"or {steps} triples, one per iteration (got {coefficients!r})")
    if not all(math.isfinite(v) for t in triples for v in t):
        raise ValueError(f"ns_coefficients must be finite (got {coefficients})")
    return triples


# The options honoured bit for bit; any other option of torch's signatures is refused at any value but torch's
# default, with its reason (one a newer torch adds, with the last one, until it is honoured here).
HONOURED = {"muon": ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"),
            "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")}
HONOURED["normuon"] = HONOURED["muon"] + tuple(NORMUON_OPTIONS)
REFUSED = {
    "foreach": "each rank steps its shards with torch's single-tensor AdamW, torch's own choice on the CPU; the "
               "multi-tensor kernels (foreach=True) are not implemented here",
    "fused": "each rank steps its shards with torch's single-tensor AdamW; the fused kernel is not implemented here",
    "capturable": "capturing the step in a CUDA graph is not implemented here",
    "differentiable": "differentiating through the step is not implemented here",
}
UNSET = (None, False)  # what torch's defaults of the refused options mean here: the single-tensor path, no graph


def class_name(algorithm):
    return f"torch.optim.{ALGORITHMS[algorithm].__name__}" if algorithm in ALGORITHMS else "NorMuon (distmuon.normuon)"


def algorithm_problem(i, algorithm):
    """Why a param group's algorithm is refused (one line naming the group), or None."""
    if algorithm not in OPTIONS:
        return f"param group {i}: algorithm must be 'muon', 'normuon' or 'adamw' (got {algorithm!r})"
    return None


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
    (torch's own limit, which it checks only inside the step). ns_coefficients: check_param_group, with ns_steps."""
    if key not in HONOURED[algorithm]:
        if value not in UNSET and value != OPTIONS[algorithm][key]:
            raise ValueError(f"{name(key)}={value!r} is refused: {refusal(algorithm, key)}")
    elif key == "lr" and torch.is_tensor(value):  # torch's Muon and AdamW take one (a scheduler fills it in place)
        if value.numel() != 1:
            raise ValueError(f"{name(key)}: Tensor lr must be 1-element (got shape {tuple(value.shape)})")
        _number(name, key, value.item())
    elif key in ("lr", "weight_decay", "eps"):
        _number(name, key, value)
    elif key in ("momentum", "beta2"):
        _number(name, key, value, high=1.0, high_open=True)
    elif key == "normuon_eps":  # a divisor's floor: zero would divide a row of zeros by zero
        _number(name, key, value)
        if value <= 0:
            raise ValueError(f"{name(key)} must be > 0 (got {value})")
    elif key == "ns_steps":
        _number(name, key, value, low=1, high=100, high_open=True, integer=True)
    elif key in ("nesterov", "amsgrad", "maximize"):
        if not isinstance(value, bool):
            raise ValueError(f"{name(key)} must be True or False (got {value!r})")
    elif key == "adjust_lr_fn":
        if value is not None and value not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {value} is not supported: {name(key)} must be None or "
                             f"one of {', '.join(ADJUST_LR_FNS)} (got {value!r})")  # torch.optim.Muon's words first
    elif key == "betas":
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ValueError(f"{name(key)} must be two numbers in [0, 1) (got {value!r})")
        for beta in value:
            _number(name, key, beta, high=1.0, high_open=True)


def check_options(name, options, bucket_size=1):
    """Options given for every group that takes them (the constructor's keywords): each must be an option of
    torch.optim.Muon, torch.optim.AdamW or NorMuon, with a value every algorithm taking it accepts; and the
    optimizer's own bucket_size (elements, >= 1)."""
    _number(name, "bucket_size", bucket_size, low=1, integer=True)
    for key, value in options.items():
        takers = [a for a in OPTIONS if key in OPTIONS[a]]
        if not takers:  # as Python refuses an unexpected keyword argument: a TypeError
            raise TypeError(f"unexpected keyword argument {name(key)!r}: not an option of torch.optim.Muon "
                            f"({', '.join(TORCH_OPTIONS['muon'])}), torch.optim.AdamW "
                            f"({', '.join(TORCH_OPTIONS['adamw'])}) or NorMuon (Muon's, {', '.join(NORMUON_OPTIONS)})")
        for algorithm in takers:
            check_option(name, algorithm, key, value)


LARGE_RUNS_CALLS = ("plan", "plan_parts", "around", "orthogonalize_tp_piece", "clip_qk_")  # section 8's LargeRuns


def check_step_arguments(*, tp_split_dims=None, strategy=None, large_runs=None):
    """The lesson's optimizer's other arguments, each refused in one line naming it: tp_split_dims a dict of names
    to dims (checked against the parameters when they are laid out), strategy a distmuon.strategy.Strategy (what it
    declares and what the step calls; its overlap an integer), large_runs a LargeRuns."""
    if tp_split_dims is not None and not (isinstance(tp_split_dims, dict) and all(isinstance(k, str) for k in tp_split_dims)):
        raise ValueError(f"tp_split_dims must be a dict {{parameter name: dim}} (got {tp_split_dims!r:.80})")
    for argument, value in (("strategy", strategy), ("large_runs", large_runs)):
        if isinstance(value, type):  # the class itself has every method, unbound: the step would fail inside
            raise ValueError(f"{argument} must be an instance, not the class {value.__name__}: give "
                             f"{argument}={value.__name__}(...)")
    if strategy is not None and not (isinstance(strategy, Strategy)  # what the step asks (distmuon.strategy)
                                     and isinstance(getattr(strategy, "overlap", None), int)):
        raise ValueError(f"strategy must be a distmuon.strategy.Strategy, as Gather() and the strategies of "
                         f"distmuon.owners.OPTIMIZERS are: its declarations and calls, an integer overlap "
                         f"(got {strategy!r:.80})")
    if large_runs is not None and not all(callable(getattr(large_runs, call, None)) for call in LARGE_RUNS_CALLS):
        raise ValueError(f"large_runs must be a distmuon.LargeRuns (got {large_runs!r:.80}, a {type(large_runs).__name__})")


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
    every step, where a value set or loaded since then is caught before anything moves (a key no option of the
    algorithm, as a scheduler cycling another algorithm's momentum writes, too). A Muon group's ns_coefficients as
    ns_coefficients_of reads them with its ns_steps (kept as given)."""
    name = group_spelling(i, group)
    unknown = sorted(set(group) - set(GROUP_KEYS) - set(SCHEDULER_KEYS) - set(OPTIONS[group["algorithm"]]))
    if unknown:
        raise ValueError(f"param group {i} ({group['algorithm']}): {', '.join(unknown)}: not an option of "
                         f"{class_name(group['algorithm'])} (set since construction? a scheduler cycling the "
                         f"momentum of another group's algorithm sets it: give it cycle_momentum=False)")
    for key in OPTIONS[group["algorithm"]]:
        check_option(name, group["algorithm"], key, group[key])
    if group["algorithm"] in ORTHOGONALIZED:
        try:
            ns_coefficients_of(group["ns_coefficients"], group["ns_steps"])
        except ValueError as e:
            raise ValueError(f"param group {i}: {e}") from None


def check_param_groups(param_groups):
    """Every group's options (once filled), each by its algorithm's rules."""
    for i, group in enumerate(param_groups):
        check_param_group(group, i)


def torch_defaults(param_groups, options):
    """optimizer.defaults as torch's optimizer of these groups has them (torch's schedulers read them: OneCycleLR
    and CyclicLR look there for a momentum or betas to cycle): its algorithm's options, the constructor's keywords
    over torch's defaults; Muon's where the groups mix algorithms (a group without one is Muon's)."""
    algorithms = {g["algorithm"] for g in param_groups}
    algorithm = algorithms.pop() if len(algorithms) == 1 else "muon"
    return {key: options.get(key, default) for key, default in OPTIONS[algorithm].items()}


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
    if algorithm_problem(i, algorithm):
        raise ValueError(algorithm_problem(i, algorithm))
    params = group.get("params")
    if params is not None and not torch.is_tensor(params):  # a generator (model.parameters()) is read once, here
        group["params"] = params = list(params)
    if params is None or (not torch.is_tensor(params) and not params):
        raise ValueError(f"param group {i} ({algorithm}) has no parameters")
    unknown = sorted(set(group) - set(GROUP_KEYS) - set(OPTIONS[algorithm]) - set(extra))
    if unknown:
        raise ValueError(f"param group {i} ({algorithm}): {', '.join(unknown)}: not an option of {class_name(algorithm)}, "
                         f"which takes {', '.join(OPTIONS[algorithm])}")
    for key, default in OPTIONS[algorithm].items():
        group.setdefault(key, options.get(key, default))
    check_param_group(group, i)
    return group


def given_names(group):
    """The names a group was given ((name, tensor) pairs, or plain tensors beside its own param_names, as torch's
    optimizers keep them), or None where it holds plain tensors only."""
    params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
    if all(torch.is_tensor(p) for p in params):
        return list(group["param_names"]) if "param_names" in group else None
    return [p[0] if isinstance(p, tuple) else None for p in params]


def name_params(group, first):
    """Plain tensors of a group, named as torch's state_dict numbers them (their index in the optimizer, from
    `first`): every optimizer here keys its layout by name. Named parameters ((name, tensor) pairs, as
    named_parameters() gives them) are kept."""
    params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
    if params and all(torch.is_tensor(p) for p in params):
        names = group.get("param_names") or [str(first + k) for k in range(len(params))]
        if len(names) != len(params):
            raise ValueError(f"a param group has {len(params)} params and {len(names)} param_names")
        params = list(zip(names, params))
    group["params"] = params
    return group


def local_view(p):
    """The tensor this rank holds of `p`: a DTensor's local shard, a plain tensor itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def viewable_flat(t):
    """Whether t.view(-1) exists (a contiguous tensor, or one evenly strided, e.g. every other column): what the
    step writes through. A transposed matrix is not."""
    try:
        t.view(-1)
    except RuntimeError:
        return False
    return True


def param_problem(name, p, stepping=True):
    """Why a parameter cannot be stepped (one line naming it and the fix), or None: at construction and at every
    step, before anything moves (torch's own step would fail halfway, after the momentum moved). A meta parameter
    is refused at the step only: an optimizer built on a meta model is a plan from shapes (the cost model's)."""
    if stepping and p.device.type == "meta":
        return (f"{name} is on the meta device (no values): an optimizer built on meta parameters plans only; "
                f"materialize them (model.to_empty(device=...), then initialize them) before stepping")
    if p.layout != torch.strided:
        return f"{name} is a sparse tensor ({p.layout}): Muon and AdamW here step dense parameters"
    if not viewable_flat(local_view(p)):
        return (f"{name} cannot be viewed flat (shape {tuple(local_view(p).shape)}, strides "
                f"{tuple(local_view(p).stride())}), as every optimizer here steps a parameter: make it contiguous "
                f"before the optimizer is built, e.g. p.data = p.data.contiguous()")
    return None


def step_device(param_groups):
    """Where a step's flags and buffers live: the first parameter's device, or the CPU for a model on the meta device
    (its optimizer plans only; its step is refused, and the refusal's vote needs values)."""
    device = param_groups[0]["params"][0].device
    return torch.device("cpu") if device.type == "meta" else device


def gradient_problem(name, g):
    """Why a gradient cannot be stepped (one line), or None: a sparse one (torch.optim.AdamW refuses it too)."""
    if g.layout != torch.strided:
        return (f"the gradient of {name} is sparse ({g.layout}): Muon and AdamW here take dense gradients "
                f"(e.g. nn.Embedding(..., sparse=False))")
    return None


def names_problem(i, group):
    """Why a group's params and param_names do not pair up (one line), or None: zip would drop the surplus."""
    if len(group.get("param_names", ())) != len(group["params"]):
        return (f"param group {i} has {len(group['params'])} params and {len(group.get('param_names', ()))} "
                f"param_names: add parameters with add_param_group")
    return None


def named_params(param_groups):
    """[(name, tensor, its group)] after the checks every optimizer here needs (DTensorMuon's too):
    'muon', 'normuon' or 'adamw' groups, their options, named floating-point parameters (state is keyed by name),
    no name twice. A tensor under two names is taken, as torch's optimizers take it (torch's add_param_group warns
    of it; torch steps it once per entry, with one state); the ZeRO-1 optimizers refuse it (index_named_params).
    Which dtypes each optimizer steps is its own check (float32_problem, complex_problem)."""
    for i, group in enumerate(param_groups):
        if algorithm_problem(i, group.get("algorithm")):
            raise ValueError(algorithm_problem(i, group.get("algorithm")))
        if "param_names" not in group:
            raise ValueError("pass named parameters: [(name, tensor), ...] (state is keyed by name)")
        if names_problem(i, group):
            raise ValueError(names_problem(i, group))
    check_param_groups(param_groups)
    named, seen = [], set()
    for group in param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            if name in seen:
                raise ValueError(f"parameter {name} appears twice")
            if not (p.dtype.is_floating_point or p.dtype.is_complex):
                raise ValueError(f"{name} is {p.dtype}: an optimizer steps floating-point parameters")
            if param_problem(name, p, stepping=False):
                raise ValueError(param_problem(name, p, stepping=False))
            seen.add(name)
            named.append((name, p, group))
    return named


MUON_COMPLEX = "Muon does not support complex parameters"  # torch.optim.Muon's words, raised at its step


def complex_problem(name, p, algorithm):
    """Why a complex parameter cannot be stepped by its group's algorithm (one line), or None. torch.optim.Muon takes
    one at construction and refuses it at step() (RuntimeError, MUON_COMPLEX); torch.optim.AdamW steps one through
    view_as_real, which DTensorMuon does not: refused at construction."""
    if not p.dtype.is_complex:
        return None
    if algorithm in ORTHOGONALIZED:
        return f"{MUON_COMPLEX}: {name} is {p.dtype}"
    return f"{name} is {p.dtype}: complex parameters of an adamw group are not implemented here"


def not_a_matrix(name, shape, expert_stacks=False):
    """Why a parameter of a Muon group that is not 2-D is refused, and what to do instead (a 3-D one: name it an
    expert stack, where the optimizer takes expert_stacks)."""
    stack = ", or name it in expert_stacks (experts, out, in)" if expert_stacks and len(shape) == 3 else ""
    return (f"Muon only supports 2D parameters whereas we found a parameter with size: {torch.Size(shape)}. "  # torch's
            f"Muon needs 2-D parameters; {name} has shape {tuple(shape)}: put it in a group of algorithm 'adamw' "
            f"(muon_param_groups splits a model the way Muon users do){stack}")


def index_named_params(param_groups, tp_split_dims):
    """({name: tensor}, {name: its group}, {name: TP split dim}) after checking what the step relies on."""
    param_by_name, group_of, tensors = {}, {}, {}
    for name, p, group in named_params(param_groups):
        if id(p) in tensors:
            raise ValueError(f"parameters {tensors[id(p)]} and {name} are the same tensor: ZeRO-1's layout gives each "
                             f"entry its own range of the flat buffers and its own state, so it would be stepped as two "
                             f"parameters, not once per entry with one state as torch's optimizers step it: pass it "
                             f"once (DTensorMuon steps it as torch does)")
        tensors[id(p)] = name
        if p.dtype != torch.float32:  # the ZeRO-1 optimizers' flat buffers are float32
            raise ValueError(f"{name} is {p.dtype}; this reference keeps float32 parameters")
        if group["algorithm"] in ORTHOGONALIZED and p.ndim != 2:
            raise ValueError(not_a_matrix(name, p.shape))
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


def check_grid(dp, tp, world=None):
    """Raise ValueError naming every factor when a DP x TP grid cannot exist (on a world of `world` ranks)."""
    for name, size in (("DP", dp), ("TP", tp)):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{name} must be an integer (got {size!r}, a {type(size).__name__})")
    if dp < 1 or tp < 1:
        raise ValueError(f"DP and TP must be >= 1 (got DP={dp}, TP={tp})")
    if world is not None and dp * tp != world:
        raise ValueError(f"world size {world} != DP {dp} x TP {tp} = {dp * tp}")


def unplanned_problem(param_groups, planned):
    """Why a step is refused because a parameter with a gradient is not one the optimizer planned for ({name:
    tensor}), or None: a tensor put into param_groups by hand, or renamed there, would be skipped silently."""
    for i, group in enumerate(param_groups):
        if names_problem(i, group):
            return names_problem(i, group)
        for name, p in zip(group["param_names"], group["params"]):
            if p.grad is not None and planned.get(name) is not p:
                return (f"{name} has a gradient but is not a parameter this optimizer planned its step for (put "
                        f"into param_groups by hand, or renamed there): add parameters with add_param_group")
    return None


def step_problem(param_groups, param_by_name):
    """Why this rank refuses a step (one line), or None: a group's option set or loaded since construction, a
    parameter with a gradient the optimizer did not plan for, or a gradient of another shape, dtype, device or
    layout than its parameter's."""
    try:
        check_param_groups(param_groups)
    except ValueError as e:
        return str(e)
    problem = unplanned_problem(param_groups, param_by_name)
    for name, p in param_by_name.items():
        g = p.grad
        problem = problem or param_problem(name, p) or (g is not None and gradient_problem(name, g)) or None
        if problem is None and g is not None and (g.shape != p.shape or g.dtype != p.dtype or g.device != p.device):
            return (f"the gradient of {name} is {g.dtype} {tuple(g.shape)} on {g.device}; "
                    f"the parameter is {p.dtype} {tuple(p.shape)} on {p.device}")
    return problem


# What clip_qk_ says, on every rank, when the optimizer was built without QK-clip.
QK_CLIP_OFF = ("QK-clip is off: construct the optimizer with qk_clip_tau (and row_layouts with q or k rows; the "
               "lesson's optimizers take both in large_runs=distmuon.LargeRuns(...))")


# -- loads: a state dict matched to the optimizer's parameters, checked whole before anything is replaced ----------
# The components torch's get/set_optimizer_state_dict drop from a parameter's name (_get_fqns, in
# torch/distributed/checkpoint/state_dict.py): torch.compile's and activation checkpointing's wrappers (and FSDP1's)
# at any depth, and DDP's leading "module" (torch drops it where the module is a DDP; here, where it leads the name).
WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
STATE_KEYS = {"muon": ("momentum_buffer",), "normuon": ("momentum_buffer", "normuon_v"),
              "adamw": ("step", "exp_avg", "exp_avg_sq")}  # and amsgrad's max_exp_avg_sq
MOMENTS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # each the shape of the parameter's state


def canonical_name(name):
    """A parameter's name as torch's checkpoint helpers key it: wrapper components dropped."""
    parts = [part for part in str(name).split(".") if part not in WRAPPER_NAMES]
    return ".".join(parts[1:] if len(parts) > 1 and parts[0] == "module" else parts)


def positional(names, first):
    """Whether `names` are positions (torch's numbering of plain tensors, as name_params gives them), not names."""
    return [str(n) for n in names] == [str(first + k) for k in range(len(names))]


def saved_order(ours, theirs, first):
    """For each of our parameter names, the index of the checkpoint's parameter whose state it takes, or None.
    By position where either side has no names (None, or positions); else by name, exactly, then as
    canonical_name spells them."""
    if theirs is None or list(theirs) == list(ours) or positional(theirs, first) or positional(ours, first):
        return list(range(len(ours)))
    for key in (str, canonical_name):
        index = {key(n): k for k, n in enumerate(theirs)}
        if len(index) == len(theirs) == len({key(n) for n in ours}) and set(index) == {key(n) for n in ours}:
            return [index[key(n)] for n in ours]
    return None


def names_saved(saved):
    """A saved group's names of its parameters: its params where they are names (torch's checkpoint helpers key
    by name), else its param_names; None where it has positions only."""
    ids = list(saved.get("params", ()))
    return ids if ids and all(isinstance(n, str) for n in ids) else saved.get("param_names")


def saved_names(param_groups, state_dict):
    """{the checkpoint's name of a parameter: this optimizer's}, as checked_state_dict matches them; {} where they
    do not match (checked_state_dict says why)."""
    names, first = {}, 0
    for group, saved in zip(param_groups, state_dict.get("param_groups", ())):
        saved = saved if isinstance(saved, dict) else {}
        ids = list(saved.get("params", ()))
        theirs = names_saved(saved) or ids
        order = saved_order(group["param_names"], theirs, first) if len(ids) == len(group["param_names"]) else None
        names.update({str(theirs[k]): ours for ours, k in zip(group["param_names"], order or ())})
        first += len(group["param_names"])
    return names


def unmatched(ours, theirs):
    """One line naming the names on either side that match none on the other (canonical_name's spelling)."""
    mine, saved = {canonical_name(n) for n in ours}, {canonical_name(n) for n in theirs}
    lost = [n for n in theirs if canonical_name(n) not in mine] or ["(none)"]
    new = [n for n in ours if canonical_name(n) not in saved] or ["(none)"]
    return (f"the checkpoint's {', '.join(map(str, lost[:6]))} match no parameter here, and this optimizer's "
            f"{', '.join(new[:6])} none of the checkpoint's (names match as torch's checkpoint helpers match them: "
            f"{'., '.join(WRAPPER_NAMES[:2])}. anywhere and a leading module. dropped)")


def saved_algorithm(saved):
    """A saved group's algorithm: its own, else torch's optimizer its options are (AdamW's have betas; a group
    without an algorithm is Muon's, as construction reads it)."""
    return saved.get("algorithm", "adamw" if "betas" in saved else "muon")


def tensor_problem(value, like):
    """Why a saved state tensor cannot replace one like `like` (a tensor, or the shape kept here), or None."""
    if not torch.is_tensor(value):
        return f"is a {type(value).__name__}, not a tensor"
    if torch.is_tensor(like) and isinstance(like, DTensor) != isinstance(value, DTensor):
        return (f"is a {type(value).__name__} where this optimizer keeps a {type(like).__name__}: load across meshes "
                f"through torch.distributed.checkpoint (distmuon.dtensor.checkpoint)")
    if isinstance(like, DTensor) and (value.placements != like.placements or value.device_mesh != like.device_mesh):
        return (f"was saved on another mesh or placements ({value.placements}): load across meshes through "
                f"torch.distributed.checkpoint (distmuon.dtensor.checkpoint)")
    shape = tuple(like.shape) if torch.is_tensor(like) else tuple(like)
    if tuple(value.shape) != shape:
        return f"has shape {tuple(value.shape)}, where this optimizer keeps {shape}"
    return None


def state_problem(name, state, group, like, optional=()):
    """Why a parameter's saved state is refused (one line), or None: none at all (it starts from zeros, as
    torch's), or its group's algorithm's keys, each a tensor of the shape (and placements) kept here."""
    if not state:
        return None
    want = set(STATE_KEYS[group["algorithm"]]) | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
    if not isinstance(state, dict) or set(state) - want or want - set(state) - set(optional):
        got = ", ".join(sorted(map(str, state))) if isinstance(state, dict) else type(state).__name__
        return f"{name}: the checkpoint keeps {got}, a {group['algorithm']} parameter {', '.join(sorted(want))}"
    for key in set(state) & (set(MOMENTS) | {"step"}):
        problem = tensor_problem(state[key], () if key == "step" else like)
        if problem:
            return f"{name}: its {key} {problem}"
    return None


def checked_state_dict(param_groups, state_dict, like, optional=(), reorder=True):
    """The state dict to hand to torch's Optimizer.load_state_dict, checked whole before anything is replaced
    (a refused load leaves the optimizer as it was); raises ValueError, one line, else.

    Each saved group is matched to ours by position, its parameters to ours by name (saved_order: wrapper
    prefixes dropped as torch's checkpoint helpers drop them; by position where a side has no names), and
    reordered to ours. Its algorithm must be ours (torch.optim.Muon's and AdamW's own state dicts have none:
    saved_algorithm), its options those of the algorithm, all of them, valid; its state per parameter
    state_problem's. The groups torch installs keep this optimizer's names (the ones its plan is keyed by) and
    the checkpoint's options. like: {name: a tensor (or shape) like its state's moments}; optional: state keys
    a parameter may lack on this rank; reorder: False where the state's layout depends on the order (ZeRO-1's
    buckets): parameters saved in another order are refused."""
    def refused(why):
        return ValueError(f"loaded optimizer state: {why}")
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        raise refused("an optimizer state dict has 'state' and 'param_groups'")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_state, dict) or not all(isinstance(g, dict) and "params" in g for g in saved_groups):
        raise refused("its 'state' must be a dict and each of its 'param_groups' a dict with 'params'")
    if len(saved_groups) != len(param_groups):
        raise refused(f"the checkpoint has {len(saved_groups)} param groups "
                      f"({', '.join(saved_algorithm(g) for g in saved_groups)}), this optimizer {len(param_groups)} "
                      f"({', '.join(g['algorithm'] for g in param_groups)}): a state dict (torch.optim.Muon's and "
                      f"AdamW's too) loads into an optimizer of the same param groups")
    groups, state, first = [], {}, 0
    for i, (group, saved) in enumerate(zip(param_groups, saved_groups)):
        algorithm = saved_algorithm(saved)
        if algorithm != group["algorithm"]:
            raise refused(f"param group {i}: the checkpoint's algorithm is {algorithm!r}, this optimizer's "
                          f"{group['algorithm']!r} (a group without one is Muon's, or AdamW's where it has betas): "
                          f"load a checkpoint of the same algorithm")
        ours, ids = group["param_names"], list(saved["params"])
        if len(ids) != len(ours):
            raise refused(f"param group {i}: the checkpoint's has {len(ids)} parameters, this optimizer's {len(ours)}")
        theirs = names_saved(saved)
        order = saved_order(ours, theirs, first)
        if order is None:
            raise refused(f"param group {i}: {unmatched(ours, theirs)}")
        if not reorder and order != sorted(order):
            raise refused(f"param group {i}: the checkpoint lists its parameters in another order, and this "
                          f"optimizer's shards depend on the order: build it with the parameters in the saved order")
        if saved.get("decoupled_weight_decay", True) is not True:  # torch.optim.Adam's, which couples the decay
            raise refused(f"param group {i} is torch.optim.Adam's (decoupled_weight_decay=False), not AdamW's")
        loaded = {k: v for k, v in saved.items() if k not in ("params", "param_names", "decoupled_weight_decay")}
        unknown = sorted(set(loaded) - set(GROUP_KEYS) - set(SCHEDULER_KEYS) - set(OPTIONS[algorithm]))
        missing = [k for k in OPTIONS[algorithm] if k not in loaded]
        if unknown or missing:
            raise refused(f"param group {i} ({algorithm}): " + "; ".join(
                ([f"{', '.join(unknown)}: not an option of {class_name(algorithm)}"] if unknown else []) +
                ([f"the checkpoint lacks {', '.join(missing)}"] if missing else [])))
        loaded.update(algorithm=algorithm, params=[ids[k] for k in order], param_names=list(ours))
        try:
            check_param_group(loaded, i)
        except ValueError as e:
            raise refused(e) from None
        for name, k in zip(ours, order):
            saved_state_of = saved_state.get(ids[k])
            if isinstance(saved_state_of, dict) and type(saved_state_of.get("step")) in (int, float):
                # an older torch's step, a number: a float32 tensor, as torch.optim.AdamW's __setstate__ makes it
                saved_state_of = dict(saved_state_of, step=torch.tensor(float(saved_state_of["step"])))
            problem = state_problem(name, saved_state_of, loaded, like[name], optional)
            if problem:
                raise refused(f"param group {i}: {problem}")
            if saved_state_of:
                state[ids[k]] = saved_state_of
        groups.append(loaded)
        first += len(ours)
    stray = [k for k in saved_state if k not in {n for g in saved_groups for n in g["params"]}]
    if stray:
        raise refused(f"state for {', '.join(map(str, stray[:6]))}, in no param group of the checkpoint")
    return dict(state_dict, state=state, param_groups=groups)


def check_layout(saved, here, state_dict=None, param_groups=None):
    """A ZeRO-1 state_dict holds one rank's shards of one layout: refuse one saved for another (naming each key
    that differs), since its shards would land on the wrong elements. Its owners are keyed by the checkpoint's
    names: read as this optimizer's (saved_names), given the state dict and the optimizer's param groups."""
    if saved is None:
        raise ValueError("state_dict has no ZeRO-1 layout: this optimizer loads the state_dict() of one of its own "
                         "ranks (one rank's shards; torch.optim.Muon's and AdamW's keep whole tensors)")
    if isinstance(saved, dict) and isinstance(saved.get("owners"), dict) and state_dict is not None:
        names = saved_names(param_groups, state_dict)
        saved = dict(saved, owners={names.get(n, n): rank for n, rank in saved["owners"].items()})
    if saved != here:
        diff = ", ".join(f"{k} {saved.get(k) if saved else None} != {v}" for k, v in here.items()
                         if not saved or saved.get(k) != v)
        raise ValueError(f"state_dict was saved for another shard layout: {diff}")


def checked_zero1_state_dict(opt, state_dict, layout):
    """What the lesson's optimizers hand torch's load: a state_dict of one rank's ZeRO-1 shards, refused unless
    saved for this `layout` (check_layout), then checked_state_dict's checks with each parameter's part on this
    rank, its parameters in the saved order only (the shards depend on it; NorMuon's v lives on the owner)."""
    state_dict = dict(state_dict)
    check_layout(state_dict.pop("layout", None), layout, state_dict, opt.param_groups)
    part_shapes = {n: (len(range(p.numel())[opt.parts[n]]),) for n, p in opt.param_by_name.items()}
    return checked_state_dict(opt.param_groups, state_dict, part_shapes, optional=("momentum_buffer", "normuon_v"),
                              reorder=False)
