"""The lesson reads top to bottom: nothing in sections 1-5 uses a name the file defines later (nor do the
files of sections 6, 7 and the tooling), and the flow's helpers come before the flow, the flow before the
class that calls it."""

import ast
import builtins
import os
import re

import pytest

from conftest import ROOT, SCRIPT

CHECKS, OWNERS, LARGE_RUNS, TOOLS = (os.path.join(ROOT, name) for name in (
    "muon_checks.py", "muon_owners.py", "muon_large_runs.py", "muon_tools.py"))


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


def test_sections_1_to_5_use_nothing_defined_later():
    """The lesson's file is sections 1-5, read top to bottom: no statement uses a name defined below it."""
    with open(SCRIPT) as f:
        source = f.read()
    assert sorted(banner_lines(source)) == [1, 2, 3, 4, 5]
    assert forward_references(source, 1, len(source.splitlines())) == []


@pytest.mark.parametrize("path", [CHECKS, OWNERS, LARGE_RUNS, TOOLS])
def test_the_files_beside_it_read_top_to_bottom_too(path):
    """Sections 6 and 7, the checks and the tooling, each in its own file, use only what comes before them too."""
    with open(path) as f:
        source = f.read()
    assert forward_references(source, 1, len(source.splitlines())) == []


def test_the_flow_comes_before_the_class_that_calls_it():
    with open(SCRIPT) as f:
        source = f.read()
    line = {n.name: n.lineno for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    order = ["dp_gather", "tp_gather", "tp_shard", "dp_shard", "gather_newton_schulz_shard", "DistributedMuon"]
    assert [line[n] for n in order] == sorted(line[n] for n in order)
    assert banner_lines(source)[5] < line["dp_gather"]
