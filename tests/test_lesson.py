"""The lesson reads top to bottom: nothing in sections 1-6 uses a name the file defines later (nor do the
files of sections 7, 8, the library's and the runner's), the flow's helpers come before the flow, the flow before
the class that calls it, and section 6 is the whole program a rank runs; its sizes stay a sitting's read. The
project's modules import one another in layers, none from a layer above (no cycle, no import tucked into a
function), and the library (distmuon/ and the lesson) imports nothing from the runner."""

import ast
import builtins
import os
import re

import pytest

from conftest import ROOT, SCRIPT

LIBRARY = sorted(os.path.relpath(os.path.join(folder, name), ROOT) for folder, _,
                 names in os.walk(os.path.join(ROOT, "distmuon"))
                 for name in names if name.endswith(".py"))
RUNNER_FILES = sorted(os.path.relpath(os.path.join(folder, name), ROOT) for folder, _, names
                      in os.walk(os.path.join(ROOT, "muon_tools")) for name in names if name.endswith(".py"))


def banner_lines(source):
    """{section number: the line of its banner '# N. Title'}."""
    return {int(m.group(1)): source.count("\n", 0, m.start()) + 1
            for m in re.finditer(r"^# (\d)\. .+$", source, flags=re.M)}


def defined_names(node):
    """The module-level names a top-level statement defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    return imported | {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def global_loads(node, local=frozenset()):
    """The names `node` reads that are not its own locals (arguments, assignments, loop and
    comprehension variables of any function around the read): the ones it looks up in the module."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = node.args
        own = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        own |= {a.arg for a in (args.vararg, args.kwarg) if a}
        body = node.body if isinstance(node.body, list) else [node.body]
        own |= {n.id for b in body for n in ast.walk(b) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        own |= {n.name for b in body for n in ast.walk(b)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)) and n.name}
        own |= set().union(set(), *(defined_names(n) for b in body for n in ast.walk(b)
                                    if isinstance(n, (ast.Import, ast.ImportFrom))))
        decorators = node.decorator_list if not isinstance(node, ast.Lambda) else []
        defaults = args.defaults + [d for d in args.kw_defaults if d is not None]
        outer = set().union(*(global_loads(d, local) for d in decorators + defaults))
        return outer | set().union(set(), *(global_loads(b, local | own) for b in body))
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, ast.Load) and node.id not in local else set()
    return set().union(set(), *(global_loads(child, local) for child in ast.iter_child_nodes(node)))


def forward_references(source, first_line, last_line):
    """[(statement's line, name)] for every name that a top-level statement between the two lines
    reads from the module although the module defines it only further down (or never)."""
    tree = ast.parse(source)
    known, problems = set(dir(builtins)) | {"__name__", "__file__"}, []
    for node in tree.body:
        if node.lineno > last_line:
            break
        if node.lineno >= first_line:
            mine = defined_names(node)  # a function's own name (recursion), what an `if` imports for itself
            problems += [(node.lineno, name) for name in sorted(global_loads(node) - known - mine)]
        known |= defined_names(node)
    return problems


def test_the_checker_finds_a_forward_reference():
    source = "# 1. A\nimport math\n\n\ndef f(x):\n    return g(x) + math.pi\n\n\ndef g(y):\n    return y\n# 6. B\n"
    assert forward_references(source, 1, 11) == [(5, "g")]
    assert forward_references(source.replace("g(x)", "x"), 1, 11) == []


def test_sections_1_to_6_use_nothing_defined_later():
    """The lesson's file is sections 1-6, read top to bottom: no statement uses a name defined below it."""
    with open(SCRIPT) as f:
        source = f.read()
    assert sorted(banner_lines(source)) == [1, 2, 3, 4, 5, 6]
    assert forward_references(source, 1, len(source.splitlines())) == []


@pytest.mark.parametrize("path", LIBRARY + RUNNER_FILES)
def test_the_files_beside_it_read_top_to_bottom_too(path):
    """Sections 7 and 8, the library's other files and the runner, each in its own file, use only what comes before
    them too."""
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    assert forward_references(source, 1, len(source.splitlines())) == []


def test_the_flow_comes_before_the_class_that_calls_it():
    with open(SCRIPT) as f:
        source = f.read()
    line = {n.name: n.lineno for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    order = ["dp_gather", "tp_gather", "tp_shard", "dp_shard", "gather_newton_schulz_shard", "DistributedMuon",
             "run_steps", "run_rank"]
    assert [line[n] for n in order] == sorted(line[n] for n in order)
    banners = banner_lines(source)
    assert banners[4] < line["dp_gather"] and line["gather_newton_schulz_shard"] < banners[5]
    assert banners[5] < line["DistributedMuon"] < banners[6] < line["run_rank"]


def calls(node):
    """The dotted names a function calls: dist.init_process_group, make_grid, opt.step, ..."""
    def dotted(f):
        return f.id if isinstance(f, ast.Name) else f"{dotted(f.value)}.{f.attr}" if isinstance(f, ast.Attribute) else "?"
    return [dotted(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]


def test_section_6_is_the_program_every_rank_runs():
    """`sed -n '/^# 6\\./,$p' distributed_muon_cpu.py` is the whole per-rank program: it joins the world, builds
    the grid, the pieces and the optimizer, steps, and compares every piece with torch's (torch.equal). Run as a
    command, the file hands over to the runner in its first lines, before anything is defined."""
    with open(SCRIPT) as f:
        source = f.read()
    section_6 = source[source.index("\n# 6. Run it\n"):]
    tree = ast.parse(section_6)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    run_rank, run_steps = calls(functions["run_rank"]), calls(functions["run_steps"])
    for name in ("dist.init_process_group", "make_grid", "run_steps", "dist.gather_object", "torch_reference",
                 "check_against_torch", "dist.destroy_process_group"):
        assert name in run_rank, name
    for name in ("initial_params", "build_optimizer", "dp_rank_grads", "opt.step", "after_step"):
        assert name in run_steps, name
    assert "torch.equal" in calls(functions["check_against_torch"])
    module = ast.parse(source).body
    main = next(n for n in module if isinstance(n, ast.If))  # if __name__ == "__main__": the runner's main
    assert all(isinstance(n, (ast.Expr, ast.ImportFrom)) for n in module[:module.index(main)])  # docstring, __future__
    assert [c for c in calls(main) if c.startswith("muon_tools")] == ["muon_tools.main"]


def test_the_lesson_is_a_sittings_read():
    """Issue 42's and 50's targets: sections 1-5 at most 650 lines (from section 1's banner to section 6's), section 5
    (the step) at most 200, the gather flow's function before line 450, the file at most 950 lines; section 1 opens
    with torch's step on one device."""
    with open(SCRIPT) as f:
        source = f.read()
    banners = banner_lines(source)
    line = {n.name: n.lineno for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert banners[6] - banners[1] <= 650
    assert banners[6] - banners[5] <= 200
    assert line["gather_newton_schulz_shard"] < 450
    assert len(source.splitlines()) <= 950
    section_1 = [n for n, at in line.items() if banners[1] < at < banners[2]]
    assert "muon_step_" in section_1 and all(line[n] < line["muon_step_"] for n in ("newton_schulz", "adjusted_lr"))


# The project's modules, in layers: each imports only modules of the layers below it (the lesson's order: the math,
# grid, buffer, flow and step below the strategies, below the runner and the demos). The library is distmuon/ and the
# lesson; the runner and the commands sit above it.
LAYERS = [
    ["distmuon.normuon", "distmuon.adamw", "distmuon.collectives", "distmuon.ledger", "distmuon.strategy",
     "distmuon.assignment",
     "muon_forkserver"],  # nothing of the project
    ["distmuon.checks"],  # the options the optimizers take (NorMuon's among them) and what they refuse
    ["distmuon.rules"],  # what every optimizer does alike: a param group added whole or not at all, a deep copy
    ["distributed_muon_cpu"],  # the lesson: math, grid, buffer, flow, the step, the run: the library's core
    ["distmuon.owners", "distmuon.large_runs"],  # sections 7 and 8: strategies and what large runs add
    ["distmuon.dtensor.placements", "distmuon.dtensor.config"],  # DTensorMuon's modules, built on all of the above
    ["distmuon.dtensor.plan"],
    ["distmuon.dtensor.rows", "distmuon.dtensor.normuon"],
    ["distmuon.dtensor.exchange", "distmuon.dtensor.explicit"],
    ["distmuon.dtensor.optimizer"],
    ["distmuon.dtensor.checkpoint"],
    ["distmuon.dtensor", "distmuon"],  # the packages' names for users
    ["muon_tools.settings",
     "collective_counter"],  # the runner: its settings, the reference, the accounting, the launcher, the command line
    ["muon_tools.reference"],
    ["muon_tools.accounting", "muon_tools.outputs", "muon_tools.training_checks"],
    ["muon_tools.launch"],
    ["muon_tools.checks"],
    ["muon_tools.cli"],
    ["muon_tools.torchrun", "muon_tools.notebook"],
    ["muon_tools"],  # the runner's names for the commands (import muon_tools)
    ["dtensor_run"],  # DTensorMuon's demo model and its run on a mesh
    ["dtensor_verify", "dtensor_accounting"],  # the demo's checks against torch; its bytes beside the lesson's
    ["dtensor_demo", "distributed_muon"],  # DTensorMuon's demo command; the lesson's GPU twin
]
RUNNER = {"muon_tools", "muon_forkserver", "collective_counter", "dtensor_run", "dtensor_verify", "dtensor_accounting",
          "dtensor_demo", "distributed_muon"}
LIBRARY_MODULES = {"distributed_muon_cpu"} | {p[:-3].replace(os.sep, ".").removesuffix(".__init__") for p in LIBRARY}
RUNNER_MODULES = {p[:-3].replace(os.sep, ".").removesuffix(".__init__") for p in RUNNER_FILES}


def module_path(module):
    """The file of a module of this repository: a top-level file, a package's __init__.py or a module of one."""
    path = os.path.join(ROOT, *module.split("."))
    return path + ".py" if os.path.exists(path + ".py") else os.path.join(path, "__init__.py")


def module_of(name, modules):
    """The longest of `modules` that a dotted import name is or lies in (distmuon.dtensor.plan for
    distmuon.dtensor.plan, distmuon for distmuon.x): the module an import loads last; else its first part."""
    parts = name.split(".")
    return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), parts[0])


def project_imports(path, modules):
    """[(line, imported module, where)] for every import of a project module in the file at `path`: where is
    "top" at module level, "function" inside a def or class, "main" inside `if __name__ == "__main__":`."""
    tree = ast.parse(open(path).read())
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                here = "function"
            elif (isinstance(child, ast.If) and isinstance(child.test, ast.Compare)
                  and getattr(child.test.left, "id", None) == "__name__"):
                here = "main"
            if isinstance(child, ast.Import):
                found.extend((child.lineno, module_of(a.name, modules), here) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:  # from a.b import c: a.b.c where it is a module
                found.extend((child.lineno, module_of(f"{child.module}.{a.name}", modules), here) for a in child.names)
            visit(child, here)

    visit(tree, "top")
    return [f for f in found if f[1] in modules]


def test_the_modules_import_each_other_in_layers():
    """A tree of layers, no cycle: a module imports only from layers below its own, at its top, never inside a
    function (the way a cycle is dodged). A command's `if __name__ == "__main__":` block is not part of the module
    but the command itself, above every layer: only the lesson has one that reaches up, handing its command line to
    the runner (its first lines: the lesson's own module never runs as that command)."""
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    top_level = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py") and not n.endswith(".nb.py")}  # not notebooks
    assert top_level | LIBRARY_MODULES | RUNNER_MODULES == set(layer)  # every module of the top level, the library and
    # the runner has its layer
    problems, upward_mains = [], []
    for module in sorted(layer):
        for line, imported, where in project_imports(module_path(module), set(layer)):
            if where == "main":
                if layer[imported] >= layer[module]:
                    upward_mains.append((module, imported))
            elif where == "function" or layer[imported] >= layer[module]:
                problems.append(f"{module}:{line} imports {imported} ({where})")
    assert problems == []
    assert upward_mains == [("distributed_muon_cpu", "muon_tools")]


def test_the_library_imports_nothing_of_the_runner():
    """distmuon/ and the lesson (what `pip install .` installs) import no module of the runner, anywhere in them,
    the lesson's command lines alone excepted (they are the runner's command, `python distributed_muon_cpu.py`)."""
    modules = RUNNER | LIBRARY_MODULES
    found = [(m, line, imported, where) for m in sorted(LIBRARY_MODULES)
             for line, imported, where in project_imports(module_path(m), modules) if imported in RUNNER]
    assert [(m, imported) for m, _, imported,
            where in found if not (m == "distributed_muon_cpu" and where == "main")] == []


def test_the_layer_check_finds_a_cycle_and_a_tucked_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\nimport muon_tools\n\ndef f():\n    from distmuon import owners\n\n"
                    "if __name__ == '__main__':\n    from distmuon.dtensor.plan import Copy\n")
    assert project_imports(str(path), {"muon_tools", "distmuon.owners", "distmuon.dtensor",
                                       "distmuon.dtensor.plan"}) == [
        (2, "muon_tools", "top"), (5, "distmuon.owners", "function"), (8, "distmuon.dtensor.plan", "main")]
