"""DTensorMuon: the optimizer, a torch.optim.Optimizer, built from the plan, the exchange and the rows.

Part of DTensorMuon (distmuon/dtensor/), section 5 of its reading order. One step, as seen from one rank:

  0. checks         every group's options (torch's rules, distmuon.checks), every parameter (one the plan does
                    not know, with a gradient, is refused; so is one that cannot be viewed flat) and gradient, then the
                    grad-presence vote: one MAX all-reduce of a flag per parameter name and one for "a rank found
                    a problem" (then EVERY rank raises, before any tensor changes). A parameter whose grad is None
                    on every rank is skipped, as torch skips it; one with a gradient somewhere takes zeros where it
                    is None (never a hang: no rank enters an exchange the others skip)
  1. on the local shard: Muon's momentum, then the update cast to bf16 (the cast Newton-Schulz does first
                    anyway: half the bytes, no bit changed), chunk by chunk (CHUNK: no float32 temporary of the shard)
  2. gather at owner     one all_to_all_single for every matrix of the step (exchange.py)
  3. Newton-Schulz       on the owner, one 2-D matrix at a time (torch's addmm path, so torch's bits), written over
                         the matrix put together there (exchange.py: two of its size at the peak, not three);
                         batched_ns stacks same-shape matrices instead (opt-in; within BATCHED_NS_BOUND);
                         ns_blocks: block by block (3b); "gram": TP pieces, each TP group together (3c)
  4. scatter from owner  one all_to_all_single back
  5. on the local shard: AdamW (elementwise: a shard gets the full tensor's bits, float32 and float64; 16-bit
                         ones where shards are multiples of 64 elements: notes/10-dtensor.md); p <- p * (1 - lr * wd) -
                         adjusted_lr * update, the adjustment from the matrix's shape (per expert: (out, in);
                         per block: each run of rows with its block's shape, 3b), chunk by chunk
  (after the step, if asked: clip_qk_, one MAX all-reduce of per-head maxima)
With exchange_bytes, stages 1-5 of the Muon parameters run group by group (at most that many bytes of bf16 matrices
each, or "one_per_owner": one matrix of each owner; the groups the plan's, the same on every rank): one exchange each
way per group, and the step's transient memory one group's, not the model's; with overlap=K, K groups' gathers are
in flight while a group's Newton-Schulz runs (the lesson's overlapped_stages on groups). The same operations on the
same elements: the same bits.
(The explicit form's gather and redistribute are yours: their results are checked and voted on, and the new
momentum is kept aside until they pass.)

Gradients are taken as already reduced: p.grad is a DTensor with p's placements holding the total gradient (what
FSDP2's reduce-scatter leaves). Optimizer state lives with the shard it belongs to, as DTensors with the
parameter's placements: the owner keeps nothing between steps, so a checkpoint reshards like the parameters
(checkpoint.py).

What large runs add (defaults: torch's behaviour; tests/test_dtensor_large_runs.py):
    opt = DTensorMuon(groups, ns_coefficients="polar_express",       # one (a, b, c) per iteration
                      row_layouts={"attn.qkv.weight": large_runs.RowLayout((hd, hd, hd), heads, ("q", "k", "v"))},
                      ns_blocks="blocks",                            # or "heads"
                      qk_clip_tau=100.0, tp_newton_schulz="gram")
    loss.backward(); opt.step(); opt.clip_qk_({"attn.qkv.weight": max_logit_per_head})
  * ns_blocks (section 3b): each block of a laid-out matrix orthogonalized alone, on its owner, with
    the lr adjusted by the block's own shape: bit-identical to torch.optim.Muon on the blocks as
    separate parameters, whatever FSDP2 / TP / HSDP cut. An expert stack's layout is one expert's:
    it applies to every expert (e.g. a fused SwiGLU gate | up).
  * clip_qk_ (after step(), every rank): one MAX all-reduce of the per-head maxima, then each rank
    scales the q and k rows it holds: bit-identical to torch's step then the rows times
    sqrt(min(1, tau / S_h)). Not for expert stacks. Its docstring has the bytes.
  * tp_newton_schulz="gram" (section 3c): a 2-D matrix whose "tp" mesh dim cuts its long side is
    orthogonalized in TP pieces by one TP group (one Gram all-reduce per iteration) instead of
    whole on one owner; the rest keep the gather (and torch's bits). NOT always torch's bits (the
    Gram matrix is a float32 sum over ranks): each step's orthogonal matrix within the lesson's
    gram_ns_tolerance, a multiple of torch's own bf16 error against the float64 iteration on that
    step's input (derived in muon_tools/reference.py, gram_ns_tolerance; how often it lands on torch's bits:
    notes/measured/from_code_comments.md).
    Bytes: each TP rank all-reduces 5 Gram matrices, ~40 m^2 (tp - 1) / tp bytes (m the short side,
    float32), where a gathered matrix's owner receives and sends ~4 m n (tp - 1) / tp bytes of bf16:
    Gram moves less only when n > 20 m, sent and received counted alike (distmuon/large_runs.py, 8.3).
  * These options are the same on every rank (checked), are not part of the state dict (pass them
    again when you resume), and need the automatic distributed_config.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distmuon import checks
from distmuon import large_runs
from distmuon import normuon
from distmuon import owners
import distributed_muon_cpu
from distmuon.adamw import adamw_step_
from distmuon.dtensor.config import DistributedConfig
from distmuon.dtensor.exchange import OwnerExchange
from distmuon.dtensor.explicit import ExplicitExchange
from distmuon.dtensor.normuon import NorMuonRows, v_zeros
from distmuon.dtensor.placements import like_param, local_of, local_shape_problem, placements_problem
from distmuon.dtensor.plan import ONE_PER_OWNER, Copy, describe, ranks_of
from distmuon.dtensor.rows import DTensorLargeRuns
from distmuon.rules import add_or_refuse_group, copy_sharing
from distributed_muon_cpu import apply_muon_update_, muon_update


CHUNK = 2**18  # elements, a multiple of every vector width: the elementwise stages' temporaries are this big,
CHUNKS = 16  # or a multiple of it that cuts a shard into at most this many (few kernel launches on an accelerator)


def chunks(numel):
    """[start, stop) of a multiple of CHUNK elements each, at most CHUNKS of them, the last one shorter: a vectorized
    kernel's tail falls where it would on the whole (the same bits)."""
    size = CHUNK * max(1, -(-numel // (CHUNKS * CHUNK)))
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def bf16_update(buffer, grad, group):
    """The lesson's muon_update (momentum in place, then the bf16 cast) chunk by chunk into one bf16 tensor:
    elementwise, so the same bits, without a temporary the size of the shard (nesterov's, in the buffer's dtype)."""
    if buffer.numel() <= CHUNK:  # one chunk: the whole shard at once (a new tensor, never the buffer)
        update = muon_update(buffer, grad, group)
        return update.clone() if update.data_ptr() == buffer.data_ptr() else update
    out = torch.empty(buffer.shape, dtype=torch.bfloat16, device=buffer.device)
    for start, stop in chunks(buffer.numel()):
        out[start:stop] = muon_update(buffer[start:stop], grad[start:stop], group)
    return out


def apply_update_(param, ortho, group, global_shape, runs=None):
    """The lesson's apply_muon_update_ chunk by chunk (each run cut at the chunk's ends): elementwise, so the same
    bits, without the float32 copy of the whole bf16 update that an add_ of mixed dtypes makes."""
    if param.numel() <= CHUNK:  # one chunk: the lesson's call as it is
        return apply_muon_update_(param, ortho, group, global_shape, runs)
    for start, stop in chunks(param.numel()):
        cut = None if runs is None else [(max(a, start) - start, min(b, stop) - start, rows) for a, b, rows in runs
                                         if a < stop and b > start]
        apply_muon_update_(param[start:stop], ortho[start:stop], group, global_shape, cut)


def _iterable(value):
    """`value` as a list, or [None] (refused) where it is no iterable."""
    try:
        return list(value)
    except TypeError:
        return [None]


def check_arguments(expert_stacks, distributed_config, batched_ns, group, row_layouts, exchange_bytes=None,
                    overlap=0):
    """DTensorMuon's own arguments of the wrong kind, each refused in one line naming it (the large-run options by
    the lesson's checks, once the parameters are known; the options of torch's optimizers by distmuon.checks)."""
    if isinstance(expert_stacks, str) or not all(isinstance(n, str) for n in _iterable(expert_stacks)):
        raise ValueError(f"expert_stacks must be a collection of parameter names (got {expert_stacks!r:.80})")
    if distributed_config is not None and not isinstance(distributed_config, DistributedConfig):
        raise ValueError(f"distributed_config must be a DistributedConfig (got {type(distributed_config).__name__})")
    if not isinstance(batched_ns, bool):
        raise ValueError(f"batched_ns must be True or False (got {batched_ns!r})")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None (got {group!r:.80})")
    large_runs.check_row_layouts_kind(row_layouts)
    owners.check_owner_options(overlap=overlap)  # the lesson's owner strategy's overlap, in its words
    named = exchange_bytes is None or isinstance(exchange_bytes, str) and exchange_bytes == ONE_PER_OWNER
    if not named and (isinstance(exchange_bytes, bool) or not isinstance(exchange_bytes, int) or exchange_bytes < 1):
        raise ValueError(f"exchange_bytes must be None, {ONE_PER_OWNER!r} or an integer >= 1 "
                         f"(got {exchange_bytes!r:.80})")
    if overlap and exchange_bytes is None:
        raise ValueError(f"overlap={overlap} needs exchange_bytes: the groups whose exchanges it keeps in flight")
    if distributed_config is not None and distributed_config.explicit and exchange_bytes is not None:
        raise ValueError("exchange_bytes needs the automatic distributed_config (an explicit one's gather is yours)")


def parameters_problem(opt):
    """Check what DTensorMuon's step relies on (its groups indexed: index_groups): the first problem as one line, or
    None. Changes nothing."""
    for name, p in opt.param_by_name.items():
        if isinstance(p, DTensor):
            why = placements_problem(name, p.placements, p.device_mesh.shape) or local_shape_problem(name, p)
            if why:
                return why
        if opt.group_of[name]["algorithm"] not in checks.ORTHOGONALIZED and p.dtype.is_complex:
            return checks.complex_problem(name, p, opt.group_of[name]["algorithm"])
        if opt.group_of[name]["algorithm"] in checks.ORTHOGONALIZED:
            if name in opt.expert_stacks:
                if p.ndim != 3:
                    return f"expert stack {name} must be 3-D (experts, out, in); it has shape {tuple(p.shape)}"
            elif p.ndim != 2:
                return checks.not_a_matrix(name, p.shape, expert_stacks=True)
    unknown = sorted(opt.expert_stacks - {n for n in opt.param_by_name
                                            if opt.group_of[n]["algorithm"] in checks.ORTHOGONALIZED})
    if unknown:
        return f"expert_stacks names no Muon parameter: {', '.join(unknown)}"
    problem = normuon.batched_problem([n for n in opt.param_by_name if opt.group_of[n]["algorithm"] == "normuon"]
                                 if opt.exchange.batched_ns else [])
    if problem:
        return problem
    if opt.exchange.config.explicit:
        if opt.expert_stacks:
            return "an explicit distributed_config takes 2-D matrices only (no expert_stacks)"
        if any(g["algorithm"] == "normuon" for g in opt.param_groups):
            return "NorMuon's param groups need the automatic distributed_config: its owner keeps each matrix's rows"
        muon = [n for n in opt.param_by_name if opt.group_of[n]["algorithm"] in checks.ORTHOGONALIZED]
        missing = [n for n in muon if n not in opt.exchange.config.global_shapes]
        if missing:
            return f"global_shapes lacks Muon matrices: {', '.join(missing)}"
    return opt.large_runs.problem(opt, opt.exchange.config.explicit)


def packed(copies):
    """Copies as ([mesh], [row]): each distinct mesh (its ranks, shape and dim names) once, in order of first use, and
    one row per Copy naming its mesh by index: what a rank sends grows with its parameters and its meshes, not with
    the parameters times the mesh's ranks."""
    index, meshes, rows = {}, [], []
    for c in copies:
        mesh = (c.mesh_ranks, c.mesh_shape, c.mesh_dim_names)
        if mesh not in index:
            index[mesh] = len(meshes)
            meshes.append(mesh)
        rows.append((c.name, c.group, c.shape, index[mesh], c.placements, c.expert_stack))
    return meshes, rows


def unpacked(meshes, rows):
    """packed's inverse: the Copies, equal field by field (one tuple of ranks per mesh, shared)."""
    return [Copy(name, group, shape, meshes[i][0], meshes[i][1], placements, expert_stack, meshes[i][2])
            for name, group, shape, i, placements, expert_stack in rows]


def agreed_copies(opt, mine, everyone):
    """From every rank's (problem, Copies, options): the first problem raised (naming its rank where it is not this
    one), or the options that differ from the first rank's; else the Copies every rank plans with (each parameter
    once per mesh; a plain tensor's only where this rank has it) and every parameter name of any rank."""
    problems = [(opt.axis.ranks[i], p) for i, (p, _, _) in enumerate(everyone) if p]
    problems += [(opt.axis.ranks[i], f"row_layouts, ns_blocks, tp_newton_schulz or qk_clip_tau differ from "
                                      f"rank {opt.axis.ranks[0]}'s: every rank must pass the same")
                 for i, (_, _, o) in enumerate(everyone) if not problems and o != everyone[0][2]]
    if problems:
        rank, why = problems[0]
        raise ValueError(why if rank == opt.me else f"rank {rank}: {why}")
    copies, seen = [], set()
    for _, theirs, _ in everyone:
        for c in theirs:
            if (c.name, c.mesh_ranks) not in seen and (c.mesh_ranks or c in mine):
                seen.add((c.name, c.mesh_ranks))
                copies.append(c)
    return copies, sorted({c.name for _, theirs, _ in everyone for c in theirs})


class DescriptionSwap:
    """The ranks' swap of descriptions: every rank's Copies, so that every rank makes the same plan, and every
    parameter name of any rank (what grad presence votes on); a problem on any rank (one line, or None here) raised
    on every rank. In two halves, so that what a rank does between them (its state made) overlaps the
    collective and the wait for the slowest rank. Started: one all_gather of a fixed-size tensor, not waited for
    (async_op): a flag "I have a problem" and a digest of this rank's Copies and options (33 bytes a rank). Finished:
    where no rank has a problem and every digest is the same (every rank describes the same parameters: FSDP2, TP,
    HSDP), every rank's Copies are this rank's and nothing more moves; else (every rank sees the same tensor, so
    every rank goes this way) one all_gather_object of each rank's problem, options and a digest of its Copies, and
    where those digests differ a second one of every rank's Copies, packed (packed()): the texts raised, and the
    Copies agreed, are the same as when everything is gathered."""

    def __init__(self, opt, problem):
        self.opt, self.problem, self.work = opt, problem, None
        index = opt.group_indices()
        self.mine = [describe(n, index[n], p, n in opt.expert_stacks) for n, p in opt.param_by_name.items()]
        self.options = None if problem else opt.large_runs.agreed()
        if opt.axis.size > 1:
            self.mine_packed = packed(self.mine)
            digest = hashlib.sha256(repr((self.mine_packed, self.options)).encode()).digest()
            # where all_gather_object's bytes would travel: the current accelerator on NCCL, else the CPU
            device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(opt.axis.group) == "nccl"
                      else torch.device("cpu"))
            sent = torch.tensor([problem is not None, *digest], dtype=torch.uint8, device=device)
            self.received = [torch.empty_like(sent) for _ in range(opt.axis.size)]
            self.work = dist.all_gather(self.received, sent, group=opt.axis.group, async_op=True)

    def settle(self):
        """Wait for the collective if it is still in flight (a rank that stops early leaves none behind)."""
        if self.work is not None:
            work, self.work = self.work, None
            work.wait()

    def finish(self):
        """(Copies every rank plans with, every parameter name of any rank); raises on every rank if any has a
        problem, or if the ranks' options differ."""
        opt, mine, options = self.opt, self.mine, self.options
        if opt.axis.size == 1:
            return agreed_copies(opt, mine, [(self.problem, mine, options)])
        self.settle()
        flags = torch.stack(self.received).cpu()
        if self.problem is None and bool((flags == flags[opt.axis.rank]).all()):  # every rank's are this one's
            return agreed_copies(opt, mine, [(None, mine, options)])
        digest = hashlib.sha256(repr(self.mine_packed).encode()).hexdigest()
        summaries = [None] * opt.axis.size
        dist.all_gather_object(summaries, (self.problem, digest, options), group=opt.axis.group)
        if all(d == digest for _, d, _ in summaries):
            everyone = [(p, mine, o) for p, _, o in summaries]
        else:
            theirs = [None] * opt.axis.size
            dist.all_gather_object(theirs, self.mine_packed, group=opt.axis.group)
            everyone = [(p, unpacked(*t), o) for (p, _, o), t in zip(summaries, theirs)]
        return agreed_copies(opt, mine, everyone)


def unpickled_axis(name, ranks, me, kind):
    """The exchange group of an unpickled DTensorMuon, re-found from what __getstate__ kept (kind: None, "world" or
    the group's name): the world where it was the world, else this process's group of that name over the same
    global ranks, else another over them (None where it had none). Refused in one line where none is found, or
    where this is not the rank that pickled it (the plan is that rank's)."""
    if kind is None:
        return distributed_muon_cpu.Axis(name, 1, 0, ranks, None)
    here = dist.get_rank() if dist.is_initialized() else None
    if here != me:
        raise ValueError(f"this DTensorMuon was pickled on rank {me} of the process group of ranks {list(ranks)}; "
                         f"unpickled {'on rank ' + str(here) if dist.is_initialized() else 'with no process group'}"
                         f": unpickle it on that rank, after init_process_group")
    from torch.distributed.distributed_c10d import _world
    world = dist.group.WORLD
    others = sorted((g for g in _world.pg_group_ranks if g is not world), key=lambda g: g.group_name != kind)
    groups = [world] + others if kind == "world" else others + [world]
    found = next((g for g in groups if tuple(dist.get_process_group_ranks(g)) == tuple(ranks)), None)
    if found is None:
        raise ValueError(f"this DTensorMuon was pickled with the process group of ranks {list(ranks)}, which this "
                         f"process does not have: create it (dist.new_group({list(ranks)})) before unpickling")
    return distributed_muon_cpu.Axis(name, len(ranks), ranks.index(me), ranks, found)


class DTensorMuon(torch.optim.Optimizer):
    """Muon for DTensor (and plain) parameters on any mesh, AdamW for the rest; bit-identical to torch.

        opt = DTensorMuon([dict(params=[(n, p) for n, p in model.named_parameters() if is_matrix(n)]),
                           dict(params=others, algorithm="adamw", weight_decay=0.0)], lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()       # every rank, after init_process_group

    The gradient contract: after backward, p.grad is the TOTAL gradient (reduced over data parallel, as FSDP2's
    reduce-scatter leaves it), a DTensor with p's mesh and placements (a plain tensor for a plain p); a Partial
    gradient is refused. Checkpoints: torch's own helpers (get/set_optimizer_state_dict, dcp) work unchanged, across
    meshes (checkpoint.py); load_state_dict matches parameters by name as they do (torch.compile's, activation
    checkpointing's and DDP's prefixes dropped) and refuses, changing nothing, what does not match. A step that
    must be refused raises on EVERY rank before anything changes; a parameter whose .grad is None on every rank is
    skipped, as torch.optim.Muon and AdamW skip it.
    """

    def __init__(self, params, *, expert_stacks=(), distributed_config=None, batched_ns=False, group=None,
                 row_layouts=None, ns_blocks="whole", tp_newton_schulz="gather", qk_clip_tau=None, exchange_bytes=None,
                 overlap=0, **options):
        """Build the plan (collective: every rank of `group` calls it with the same parameter names).

        params: as torch's optimizers take them: tensors, (name, tensor) pairs (model.named_parameters()), or param
            groups {"params": ..., "algorithm": "muon" | "adamw", options}, "muon" if not given
            (distmuon.muon_param_groups(model) splits a model the way Muon users do); owners are keyed by the names.
            Muon parameters are 2-D, or 3-D expert stacks (E, out, in) named in expert_stacks; DTensors (Shard,
            _StridedShard or Replicate placements on any mesh) or plain tensors, of any real floating dtype, stepped
            as torch steps it (momentum and the update added in the parameter's dtype, Newton-Schulz in bf16).
        options (keywords): any option of torch.optim.Muon or torch.optim.AdamW, the default of every group that
            takes it (a group's own win, then torch's defaults), by torch's rules; ns_coefficients may also be one
            triple per iteration or "polar_express". What is not honoured bit for bit is refused.
        expert_stacks: names of 3-D Muon parameters whose dim 0 indexes experts, each expert its own matrix.
        distributed_config: DistributedConfig (config.py); None: automatic from the placements.
        batched_ns: same-shape matrices in one batched call: not bitwise torch's (within BATCHED_NS_BOUND).
        group: the process group of the exchanges (default: the world); every rank of it builds the optimizer and
            calls step() (and add_param_group, clip_qk_) together.
        row_layouts, ns_blocks, tp_newton_schulz, qk_clip_tau: what large runs add (this module's docstring), the
            same on every rank: torch's behaviour by default.
        exchange_bytes: None (every matrix in one exchange each way), or the most bytes of bf16 matrices in one group:
            the step goes group by group (momentum, gather, Newton-Schulz, scatter, update), so its transient memory
            is bounded by a group, not the model; the same bits, one exchange each way per group. A group of one
            matrix has one owner, whom the others wait for: "one_per_owner" (plan.one_per_owner) makes groups in
            which each owner has one matrix, all of them at work in each group while they have matrices left; on 2
            to 4 ranks here as fast as one exchange, holding about 2.5 of the largest matrix in bf16 beside the state
            (notes/10-dtensor.md, "At the sizes you train"; notes/12-cost-model.md prices groups on a cluster).
        overlap: 0 (off), or K >= 1 (with exchange_bytes): K groups' gathers in flight while a group's Newton-Schulz
            runs; the same bits.
        """
        checks.check_options(str, options)
        check_arguments(expert_stacks, distributed_config, batched_ns, group, row_layouts, exchange_bytes, overlap)
        self.options, self.exchange_bytes, self.overlap = options, exchange_bytes, overlap
        self.given_names = []  # per group: the param_names torch's optimizer would report, or None (see state_dict)
        super().__init__(params, {})  # each group's options are filled by add_param_group, per its algorithm
        self.defaults = checks.torch_defaults(self.param_groups, options)  # torch's optimizer's, which schedulers read
        config = distributed_config or DistributedConfig()
        config.check()
        self.ledger, self.expert_stacks = distributed_muon_cpu.Ledger(), set(expert_stacks)
        # the strategy (who orthogonalizes what, how it travels), and NorMuon's rows beside it (normuon.py)
        self.exchange = (ExplicitExchange if config.explicit else OwnerExchange)(config, batched_ns)
        self.normuon_rows = NorMuonRows()
        self.large_runs = DTensorLargeRuns(row_layouts, ns_blocks, tp_newton_schulz, qk_clip_tau)
        self.axis = self._axis(group)
        self.me = self.axis.ranks[self.axis.rank]  # global ranks everywhere; the exchange maps them to the group's
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._plan()

    def __deepcopy__(self, memo):
        """A copy that steps (torch's Optimizer copies only defaults, state and param_groups): every attribute,
        parameters and state copied; the process group and device meshes shared (the copy steps on the same ranks)."""
        return copy_sharing(self, memo, [self.axis.group] + [p.device_mesh for p in self.param_by_name.values()
                                                              if isinstance(p, DTensor)])

    def __getstate__(self):
        """Every attribute but torch's hooks (torch's own pickle leaves them out too); the process group as its
        ranks (re-found on unpickling: unpickled_axis)."""
        state = {k: v for k, v in self.__dict__.items() if not k.endswith("_hooks")}
        group = self.axis.group
        state["axis"] = (self.axis.name, self.axis.ranks, self.me,
                         None if group is None else "world" if group is dist.group.WORLD else group.group_name)
        return state

    def __setstate__(self, state):
        """An unpickling, or torch's load_state_dict (which sets the state and param_groups through here)."""
        axis = state.pop("axis", None)
        super().__setstate__(state)  # torch's: its hooks made anew, its step patched
        if axis is not None:
            self.axis = unpickled_axis(*axis)

    def add_param_group(self, param_group):
        """torch's, each option filled and checked per the group's algorithm (distmuon.checks). Called after
        construction (on every rank of the group alike: it is collective), the plan is made again with the new
        group: the state of the others is kept (it lives with the parameters' shards, whoever owns what). Refused
        (on every rank, if any rank refuses it), it leaves the optimizer as it was."""
        kept = []

        def check(group):  # torch's check of names, its words
            named = checks.given_names(group)
            if self.given_names and (named is None) != (self.given_names[0] is None):
                raise ValueError(f"all optimizer param groups should be with/without names. cannot add param group "
                                 f"{'without' if named is None else 'with'} names to the optimizer")
            kept.append(named)

        def add(group):
            torch.optim.Optimizer.add_param_group(self, group)
            self.given_names.append(kept[0])

        # torch's constructor adds the first groups, planned together after it (no axis yet: no relayout)
        add_or_refuse_group(self, param_group, add, self.options, self._plan if hasattr(self, "axis") else None,
                            check=check, restore=dict(given_names=list(self.given_names)))

    @torch.no_grad()  # nothing here is differentiated: a parameter's to_local() records no autograd node
    def _plan(self):
        """Index and check the parameters, agree with every rank, plan who orthogonalizes what; create the state."""
        self.param_by_name, self.group_of = {}, {}
        problem = self.index_groups() or parameters_problem(self)  # raised below on every rank at once, never a hang
        swap = DescriptionSwap(self, problem)  # started: the state is made while it travels
        # Every state tensor exists from the start (zeros, step 0: what torch creates at a first step), so that
        # torch's get/set_optimizer_state_dict find it and never run their own zero-gradient step. Made before the
        # ranks agree; refused, the state made here goes again (a refused add_param_group changes nothing).
        fresh = {p: p in self.state for p in self.param_by_name.values() if not self.state.get(p)}
        try:
            if problem is None:
                self.init_state()
            copies, self.names = swap.finish()
            self.exchange.plan(self, copies)
            self.normuon_rows.plan(self, self.exchange.matrices)
            if not self.exchange.config.explicit:
                self.large_runs.plan_rows(self, describe)
        except BaseException:
            swap.settle()
            for p, had_entry in fresh.items():
                if had_entry:
                    self.state[p].clear()
                else:
                    self.state.pop(p, None)
            raise
        self.planned = dict(self.param_by_name)  # what the plan knows: a step refuses any other parameter

    # -- construction -------------------------------------------------------
    @staticmethod
    def _axis(group):
        """The exchange group as the lesson's Axis: global ranks, this rank's index, the ProcessGroup."""
        if not dist.is_initialized():
            return distributed_muon_cpu.Axis("world", 1, 0, (0,), None)
        group = group or dist.group.WORLD
        ranks = ranks_of(dist.get_process_group_ranks(group))
        return distributed_muon_cpu.Axis("world", len(ranks), ranks.index(dist.get_rank()), ranks, group)

    def index_groups(self):
        """{name: its param group} (groups found by identity, never ==) after the lesson's checks of the named
        parameters and every group's options (checks.named_params); the first problem as one line, or None."""
        try:
            named = checks.named_params(self.param_groups)
        except ValueError as e:
            return str(e)
        self.group_of = {name: group for name, _, group in named}
        self.param_by_name = {name: p for name, p, _ in named}
        return None

    def group_indices(self):
        """{parameter name: the index of its param group} (index_groups first), each group found by identity, once:
        never param_groups.index(group), whose == compares the groups' tensors."""
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        return {name: index[id(group)] for name, group in self.group_of.items()}

    # -- what the plan says --------------------------------------------------
    @property
    def owners(self):
        """{matrix: owner rank} of every distributed matrix; local ones are orthogonalized where they are."""
        return self.exchange.owners

    ns_flops = property(lambda self: self.exchange.ns_flops, doc="{matrix: its Newton-Schulz FLOPs}")
    matrices = property(lambda self: self.exchange.matrices, doc="the plan's distributed matrices (plan.Matrix)")
    local_matrices = property(lambda self: self.exchange.local_matrices, doc="{parameter: its matrices, local}")
    batched_ns = property(lambda self: self.exchange.batched_ns)
    qk_clip_tau = property(lambda self: self.large_runs.qk_clip_tau,
                           lambda self, tau: setattr(self.large_runs, "qk_clip_tau", tau))  # checked at every clip_qk_

    @property
    def device(self):
        return checks.step_device(self.param_groups)

    # -- state ---------------------------------------------------------------
    def state_of(self, name):
        """This parameter's state, created on first use as torch does (zeros, step 0), as DTensors like p."""
        p = self.param_by_name[name]
        state = self.state[p]
        if not state:
            zeros = lambda: like_param(p, torch.zeros_like(local_of(p), memory_format=torch.contiguous_format))
            if self.group_of[name]["algorithm"] in checks.ORTHOGONALIZED:
                state["momentum_buffer"] = zeros()
                if self.group_of[name]["algorithm"] == "normuon":  # one float32 per row (distmuon/dtensor/normuon.py)
                    state["normuon_v"] = v_zeros(p, name in self.expert_stacks)
            else:  # torch.optim.AdamW's: the moments, and amsgrad's running maximum
                state.update(step=torch.tensor(0.0), exp_avg=zeros(), exp_avg_sq=zeros())
                if self.group_of[name]["amsgrad"]:
                    state["max_exp_avg_sq"] = zeros()
        return state

    def load_state_dict(self, state_dict):
        """torch's load, after the checkpoint is checked whole and matched to the parameters by name
        (distmuon.checks.checked_state_dict: a refused load changes nothing); then the groups torch installed
        (this optimizer's names, the checkpoint's options) re-indexed, so that the step reads them."""
        like = {name: self.state_of(name)["momentum_buffer" if "momentum_buffer" in self.state_of(name)
                                            else "exp_avg"] for name in self.param_by_name}
        checked = checks.checked_state_dict(self.param_groups, state_dict, like)
        super().load_state_dict(checked)
        for i, (saved, loaded) in enumerate(zip(state_dict["param_groups"], checked["param_groups"])):
            if "param_names" in saved:  # torch's load gives the group the checkpoint's names, in our order here
                name_of = dict(zip(saved["params"], saved["param_names"]))
                self.given_names[i] = [name_of[k] for k in loaded["params"]]
        problem = self.index_groups()
        if problem:  # checked_state_dict checked every group: a failure here is a bug, said as such
            raise AssertionError(f"loaded optimizer state passed its checks, then: {problem}")
        self.init_state()  # a parameter the checkpoint had no state for starts from zeros

    def state_dict(self):
        """torch's, each group's param_names as torch's optimizer has them: the names it was given (or loaded),
        none where it was given plain tensors (the names the plan is keyed by, "0", "1", ..., stay in
        param_groups)."""
        state_dict = super().state_dict()
        for group, names in zip(state_dict["param_groups"], self.given_names):
            if names is None:
                group.pop("param_names", None)
            else:
                group["param_names"] = list(names)
        return state_dict

    def init_state(self):
        """Create every parameter's state now (zeros, step 0), e.g. as the target of a checkpoint load."""
        for name in self.param_by_name:
            self.state_of(name)

    def state_bytes(self):
        return sum(local_of(t).numel() * local_of(t).element_size()
                   for s in self.state.values() for t in s.values() if torch.is_tensor(t))

    # -- the step -----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ledger.step += 1
        # Every check before anything changes, and voted on: a group's options (they may have been changed, or
        # loaded, since construction) and every gradient; one rank's problem stops every rank, here.
        group_problem = self.index_groups() or checks.unplanned_problem(self.param_groups, self.planned)
        grads, problem = self._local_grads()
        try:
            active, present = self._vote_on_gradients(grads, group_problem or problem)
        except ValueError as e:  # torch.optim.Muon refuses a complex parameter at its step with a RuntimeError
            if (group_problem or problem or "").startswith(checks.MUON_COMPLEX):
                raise RuntimeError(str(e)) from None
            raise
        # Flat views of every local tensor: elementwise math does not care about shape, and an empty
        # shard's local shape may differ between FSDP2's parameter and a gradient made by distribute_tensor.
        flat = lambda t: local_of(t).view(-1)
        muon = [n for n in active if self.group_of[n]["algorithm"] in checks.ORTHOGONALIZED]
        momenta = {}  # the explicit form's new momentum, kept aside until its checks pass
        self._muon_steps(present, muon, grads, momenta)
        for name in [n for n in active if self.group_of[n]["algorithm"] == "adamw"]:
            state = {k: flat(t) for k, t in self.state_of(name).items()}  # "step" too: a view, updated in place
            adamw_step_(flat(self.param_by_name[name]), grads[name].reshape(-1), state, self.group_of[name])
        for name, momentum in momenta.items():  # the checks passed: the new momentum now
            flat(self.state[self.param_by_name[name]]["momentum_buffer"]).copy_(momentum)
        return loss

    def _muon_updates(self, names, grads, momenta):
        """{name: the bf16 update of this rank's shard} after Muon's momentum: in place, or, for the explicit form,
        whose gather / redistribute may fail the checks after them (a refused step changes nothing), in a copy kept
        in momenta."""
        updates, flat = {}, lambda t: local_of(t).view(-1)
        for name in names:
            group, buffer = self.group_of[name], flat(self.state_of(name)["momentum_buffer"])
            if self.exchange.config.explicit:
                buffer = momenta[name] = buffer.clone()
            update = bf16_update(buffer, grads[name].reshape(-1), group)
            updates[name] = update.view(local_of(self.param_by_name[name]).shape)
        return updates

    def _apply_orthogonalized(self, orthos):
        """p <- p * (1 - lr * wd) - adjusted_lr * O for each parameter's orthogonalized shard."""
        for name in list(orthos):
            shape = (self.exchange.config.global_shapes[name] if self.exchange.config.explicit
                     else tuple(self.param_by_name[name].shape)[-2:])  # an expert's (out, in)
            apply_update_(local_of(self.param_by_name[name]).view(-1), orthos.pop(name).reshape(-1),
                          self.group_of[name], shape, self.large_runs.block_runs.get(name))  # blocks: 3b

    def _muon_steps(self, present, muon, grads, momenta):
        """Stages 1-5 of the Muon parameters (muon: those with a gradient here), group by group: without exchange_bytes
        one group of them all, which every rank runs (its exchanges too, with nothing of its own to send); else
        exchange.exchange_groups'. K = overlap groups' gathers in flight while a group's Newton-Schulz runs, its
        scatter waited for K groups later (the lesson's overlapped_stages, on groups): the same operations on the same
        elements, so the same bits. Each group's update is applied as it arrives, and nothing of a group is held after
        it. momenta: as _muon_updates keeps them."""
        groups = ([(muon, True, True)] if self.exchange_bytes is None
                  else self.exchange.exchange_groups(self, present, self.exchange_bytes))
        here = set(muon)
        k, started, finishing = self.overlap, {}, {}
        # iteration i:   start group i  |  finish group i-k  |  apply group i-2k   (k = 0: all three on group i)
        #   k = 1:  i = 0: start 0;  i = 1: start 1, finish 0;  i = 2: start 2, finish 1, apply 0;  ...
        for i in range(len(groups) + 2 * k):
            if i < len(groups):  # group i: momentum and bf16 updates, then its gather started
                names, exchanged, rows = groups[i]
                started[i] = (exchanged, rows, self.exchange.start(
                    self, self._muon_updates([n for n in names if n in here], grads, momenta), exchanged))
            if i - k in started:  # group i-k: Newton-Schulz while later groups' gathers fly; its scatter started
                exchanged, rows, gathering = started.pop(i - k)
                finishing[i - k] = self.exchange.finish(self, gathering, exchanged, rows)
                del gathering
            if i - 2 * k in finishing:  # group i-2k: its scatter waited for, its update applied
                self._apply_orthogonalized(finishing.pop(i - 2 * k)())

    def _local_grads(self):
        """{name: local gradient or None} and the first problem with them (one line, or None)."""
        grads, problem = {}, None
        for name, p in self.param_by_name.items():
            g = p.grad
            problem = problem or checks.param_problem(name, p) or (g is not None and (
                checks.complex_problem(name, p, self.group_of[name]["algorithm"])
                or checks.gradient_problem(name, g))) or None
            if g is not None and problem is None:
                if isinstance(p, DTensor) and not (isinstance(g, DTensor) and g.placements == p.placements
                                                   and g.device_mesh == p.device_mesh):
                    placements = g.placements if isinstance(g, DTensor) else "a plain tensor"
                    problem = placements_problem(f"the gradient of {name}", g.placements, g.device_mesh.shape) \
                        if isinstance(g, DTensor) else None
                    problem = problem or (f"the gradient of {name} is {placements}, the parameter "
                                          f"{p.placements}: give it the parameter's placements")
                elif g.shape != p.shape or local_of(g).numel() != local_of(p).numel():
                    problem = (f"the gradient of {name} has shape {tuple(g.shape)} (here {tuple(local_of(g).shape)}), "
                               f"the parameter {tuple(p.shape)} (here {tuple(local_of(p).shape)})")
            grads[name] = None if g is None else local_of(g)
        return grads, problem

    def _vote_on_gradients(self, grads, problem):
        """The names to update this step here, and those present on any rank (the same on every rank); raise on every
        rank if any found a problem."""
        flags = torch.tensor([n in grads and grads[n] is not None for n in self.names],
                             device=self.device)  # NCCL reduces device tensors only
        votes = distributed_muon_cpu.vote(flags, problem, self.me, self.axis, self.ledger, "grad presence")
        present = {n for n, v in zip(self.names, votes.tolist()) if v}
        for name in present & set(grads):
            if grads[name] is None:  # a gradient elsewhere but not here: zeros, as DDP's reduction would give
                grads[name] = torch.zeros_like(local_of(self.param_by_name[name]))
        return [n for n in self.param_by_name if n in present], present

    def refuse_on_every_rank(self, problem, phase):
        """Raise on every rank of the group if any rank found a problem: the lesson's vote, with no flags."""
        distributed_muon_cpu.vote(torch.empty(0, dtype=torch.bool, device=self.device), problem, self.me, self.axis,
                                  self.ledger, phase)

    @torch.no_grad()
    def clip_qk_(self, max_logits):
        """Kimi K2's per-head QK-clip, after step(): collective, every rank of the group calls it. The
        contract (max_logits, one float32 per query head of the full matrix; refusals, naming the rank; the
        multipliers returned) is the lesson's: help(distmuon.large_runs.LargeRuns.clip_qk_), and so is its one
        collective, large_runs.exchange_max_logits: ONE all-reduce MAX over the optimizer's group of n ranks of
        H + 1 float32 values, the heads of every parameter of clip_names in that order, then the refusing
        rank: each rank sends and receives 2 (n - 1) x ceil((H + 1) / n) x 4 bytes (a ring's count; the
        Ledger's phase "QK-clip maxima"), e.g. 72 B for H = 10 heads on 4 ranks. For separate W_q and W_k
        of multi-head attention, pass the same maxima under both names (under GQA, leave W_k out: its keys
        are shared). A head's rows are held here if any of its scaled rows is in this rank's local shard,
        wherever FSDP2 and TP cut (section 3b); each run of them is multiplied by its head's multiplier
        (large_runs.qk_clip_scales), bit-identical to torch's step then those rows times it.
        """
        return self.large_runs.clip_qk_(self, max_logits, self.large_runs.options_problem())

