"""The runner: the lesson's demo run set up, torch's reference, the report, the launcher, the command line.

distributed_muon_cpu.py is the lesson (sections 1-6: the gather flow, its optimizer and its run) and the core of
the library, distmuon/ (distmuon/owners.py its section 7, the owner and comm-free strategies; distmuon/large_runs.py
its section 8, what large runs add). What is here is what a command needs around them, and nothing a reader of
the algorithm must read: it continues the lesson's numbering, a module per concern, each read top to bottom.
The library imports nothing from it.

    9. settings.py         the run's settings (RunConfig, the models of --model, the optimizer of --strategy and
                           the options)
       reference.py        torch's reference (reference_params) and the bounds of the two opt-ins that are not
                           bit for bit
    10. accounting.py      bytes per phase, Newton-Schulz FLOPs, redundancy, balance, and the report
    11. outputs.py         what a command writes (atomically) and the checkpoint it resumes from
        launch.py          the launcher: start, watch and stop the ranks (RankFailure)
        checks.py          the checks of a command's options, before any rank starts
        cli.py             run, the parser, how a command ends (exit_code), main
        torchrun.py        the same under torchrun (run_under_torchrun, main_under_torchrun)
        notebook.py        the notebooks' helpers
    12. training_checks.py how a real training is checked against one process (the bound on its gradients,
                           the chaos floor), for examples/train_gpt.py and dtensor_demo.py alike

The launcher (spawn_ranks, run_under_torchrun, exit_code, RankFailure; its forkserver and janitor are in
muon_forkserver.py, without torch, for a command's first lines to start), the table formatting
(format_table, human_bytes), the parser (OneLineParser) and the checks of a command's options
(check_launch, check_writable, flag) serve every command of the repository: distributed_muon.py,
dtensor_demo.py, examples/ and benchmarks/ import them from here (`import muon_tools`:
every name below is the package's), and the training checks (bound_ratio, loss_drift, one_ulp_up) too.
`python distributed_muon_cpu.py` runs main (cli.py); `torchrun ... distributed_muon.py` runs main_under_torchrun.
"""

from muon_tools.settings import (  # noqa: F401
    BASELINE, FUSED_QKV, MAX_WORLD, MODELS, MUON_GROUP, N_HEADS, RunConfig, TIMEOUT_S, after_demo_step, after_step,
    build_optimizer, check_tp_divides, computed_here, demo_row_layouts, demo_specs, dp_rank_max_logits,
    group_hyperparameters, lopsided_specs, plan_optimizer, run_kind, thin_specs, tp_local_shape,
    transformer_row_layouts)
from muon_tools.reference import (  # noqa: F401
    GRAM_ERROR_RATIO, NorMuonReference, batched_ns_tolerance, bound, clip_rows_, gram_names, gram_ns_tolerance,
    gram_tolerance, muon_groups_of, ns_inputs_recorded, rank_program, reference_params, run_demo_steps,
    torch_newton_schulz_per_iteration, torch_optimizers, torch_reference_steps, total_grads, verdict, verify)
from muon_tools.accounting import (  # noqa: F401
    PHASES, PHASES_OF, account, bytes_per_step, flops_per_step, format_buffer_map, format_grid, format_table,
    human_bytes, print_header, qk_clipped_heads, report, rounded_parts, total_bytes)
from muon_tools.outputs import (  # noqa: F401
    WriteError, check_checkpoint_model, check_not_input, check_outputs, check_writable, is_code_file, one_line,
    read_checkpoint, save_figure, umask, write_atomically, write_folder_atomically, write_json)
from muon_tools.launch import (  # noqa: F401
    ERRORS_LAND_S, HEARTBEAT_S, POLL_S, SECONDHAND, Interrupted, RankFailure, culprit_failure, end_if_orphaned,
    free_port, is_secondhand, name_process, raise_interrupted, rank_errors, rank_process, run_processes, spawn_ranks,
    start_heartbeat, start_method, stop, watch, worker_process)
from muon_tools.checks import (  # noqa: F401
    FLOAT32_MAX, MAX_DEMO_PARAMETERS, MAX_LAYERS, MAX_TIMEOUT_S, MIN_TIMEOUT_S, MUON_ONLY, TORCH_ADAMW_BETAS,
    add_backend_flags, backend_flags, check_large_run_flags, check_launch, check_seed, check_step_numbers,
    check_topology, either, flag, host_memory, under_torchrun, validate)
from muon_tools.cli import (  # noqa: F401
    CLOSED_STDOUT, OneLineParser, build_parser, closed_stdout, config_from_args, exit_code, leave, main,
    not_under_torchrun, run, stdout_closed)
from muon_tools.torchrun import (  # noqa: F401
    check_devices, environment, join_world, main_under_torchrun, rank_device, run_under_torchrun)
from muon_tools.notebook import (  # noqa: F401
    notebook_requirements, on_thread_ranks, run_program, show_source)
from muon_tools.training_checks import (  # noqa: F401
    REALIZED_FACTOR, UNIT_ROUNDOFF, bound_ratio, loss_drift, one_ulp_up)
