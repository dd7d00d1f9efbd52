"""What the lesson's step (distributed_muon_cpu.py, section 5) and its strategy see of each other, typed.

A strategy is what the optimizer plugs in to say where each matrix is orthogonalized and how its pieces travel there
and back: the lesson's Gather (section 4), distmuon/owners.py's Owner and CommFree (section 7), each wrapped by
distmuon/large_runs.py's WithLargeRuns when large runs' options are on (section 8). The step calls a Strategy; a
strategy reads and calls only what a StepContext has (the optimizer is one), never an underscored attribute.

A strategy also declares, as class attributes, what the rest of the house asks of it (the runner's checks and
accounting, large runs, the benchmarks): nobody branches on its name. One that does not orthogonalize each matrix
once runs section 4's gather flow, whose three middle arrows (its `middle`) large runs replace. Adding a strategy:
notes/08-strategies.md.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StepContext(Protocol):
    """The optimizer as a strategy sees it: where everything lives, and the step's own stages."""

    grid: Any  # make_grid's Grid: rank, dp, tp, world axes
    ledger: Any  # distmuon.ledger.Ledger: what moved and what was computed
    param_groups: list  # torch's, each option filled per its algorithm
    state: dict  # torch's: {parameter: its state}, this rank's part only
    layout: Any  # section 3's Layout: buckets and every DP rank's dist_meta
    dist_metas: dict  # {name: this DP rank's DistMeta}
    param_by_name: dict  # {name: this rank's TP piece}
    group_of: dict  # {name: its param group}
    muon_names: list  # the matrices Newton-Schulz orthogonalizes, in order
    parts: dict  # {name: the slice of its flat TP piece this rank keeps state for}
    bucket_size: int
    device: Any
    strategy: "Strategy"  # the strategy the step calls (a wrapper's, when wrapped)
    large_runs: Any  # None, or distmuon.large_runs.LargeRuns

    def stages_in_turn(self, active: set) -> None: ...  # the four stages, one unit at a time
    def update_state(self, grads: dict) -> dict: ...  # stage 2: {matrix: its update part, bf16}
    def apply_update(self, name: str, ortho_part: Any) -> None: ...  # the end of stage 3
    def grad_bucket(self, bucket: Any) -> Any: ...  # stage 1's input: this rank's gradients laid out as a bucket
    def grad_parts(self, bucket: Any, grad_shard: Any, active: set) -> dict: ...  # stage 1's output, per name
    def param_shard(self, bucket: Any) -> Any: ...  # stage 4's input: this DP rank's shard of a bucket
    def copy_in(self, bucket: Any, param_bucket: Any) -> None: ...  # stage 4's output, into the TP pieces


# What a strategy's class declares, read before any is built (distmuon.owners.strategy_class): Strategy's first five.
DECLARED = ("name", "phases", "own_options", "orthogonalizes_once", "holds_rows")


@runtime_checkable
class Strategy(Protocol):
    """What the step asks a strategy (section 5 calls each, given the optimizer as a StepContext)."""

    name: str  # "gather", "owner", "comm-free": what --strategy takes and a checkpoint records
    phases: tuple  # the ledger phases its step records, in order (the runner's table of bytes per phase)
    own_options: tuple  # its keywords that a run's flags set (its optimizer takes them too): the runner passes them
    orthogonalizes_once: bool  # True: each matrix once, by its owner; False: by every rank that touches it
    holds_rows: bool  # its owner holds each matrix's whole rows: NorMuon's groups need it (distmuon/normuon.py)
    owners: dict | None  # {matrix: the rank that orthogonalizes it}; None: every rank that touches it
    overlap: int  # 0: the stages in turn; K: pipelined K units deep (section 7.6)

    def plan(self, opt: StepContext) -> None: ...  # once the layout is known (again when a group is added)
    def bucketed(self, opt: StepContext, name: str) -> bool: ...  # whether ZeRO-1's buckets hold the parameter
    def part_of(self, opt: StepContext, name: str, dp_rank: int) -> slice: ...  # which slice a DP rank keeps
    def units(self, opt: StepContext) -> list: ...  # what the stages take at once (Unit)
    def stages(self, opt: StepContext, active: set) -> None: ...  # the four stages of a step
    def orthogonalize(self, opt: StepContext, unit: Any, updates: dict, active: set) -> dict: ...  # stage 3
    def runs_of(self, name: str) -> list | None: ...  # None: the lr adjusted for the whole matrix's shape
    def clip_qk_(self, opt: StepContext, max_logits: dict) -> dict: ...  # QK-clip after the step, or refused


@runtime_checkable
class ChunkStrategy(Strategy, Protocol):
    """A strategy whose units carry chunks (Unit.chunks: matrices outside ZeRO-1's buckets, as comm-free's): the step
    calls these two for each chunk of a unit, stage 1 and stage 4; for a strategy whose units carry none, never."""

    def reduce_chunk(self, opt: StepContext, chunk: tuple, active: set, async_op: bool = False) -> Any:
        """Stage 1: {name: this rank's part of the gradient summed over DP}; with async_op, a function that waits
        and returns it."""

    def broadcast_chunk(self, opt: StepContext, chunk: tuple, active: set, async_op: bool = False) -> Any:
        """Stage 4: every DP rank's copy of the chunk's weights updated; with async_op, a function that waits for it."""
