"""The package's structure, read from its imports (every `import` statement, inside functions too): no
module imports one that imports it back, the kernels import nothing above them, and nothing below the
modes sees the app, the job's Hydra config or the benches; each strategy option is a module of its own; the
layer's own pieces never choose their implementation by a tensor's device."""
from __future__ import annotations

import ast
from pathlib import Path

import dsv4

ROOT = Path(dsv4.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every module this file imports (dsv4's by their module, others by their top package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        for n in names:
            out.add(n if n in MODULES else n.split(".")[0])
    return out


GRAPH = {m: imports(p) - {m} for m, p in MODULES.items()}


def test_no_module_imports_one_that_imports_it_back():
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for d in GRAPH.get(todo.pop(), ()):
                if d in MODULES and d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    cycles = sorted(m for m in MODULES if m in reach(m))
    assert not cycles, f"modules on an import cycle: {cycles}"


# dsv4's folders from the bottom up: a module imports only modules of its own floor or of floors below it
FLOORS = (
    ("dsv4.values",),                       # the model's shapes, layer types, device, settings, errors, seam
    ("dsv4.formats", "dsv4.oracle"),        # row formats and numerics in torch; the whole-sequence oracle
    ("dsv4.kernels",),                      # our Triton kernels
    ("dsv4.strategies",),                   # the options of the six groups
    ("dsv4.components",),                   # the layer, its pool, its engine
    ("dsv4.checks",),                       # the catalogue of options and check()
    ("dsv4.reports",),                      # result rows, tables, sweep summaries
    ("dsv4.app", "dsv4.speed"),             # the command line, modes and jobs; the benchmarks
    ("dsv4.api", "dsv4", "dsv4.__main__"),  # the public Python API, `python -m dsv4`
)
# the one import that reaches up, lazily: a checkpoint's config.json is named by the model presets it matches,
# which the catalogue reads from configs/
REACHES_UP = {("dsv4.components.checkpoint", "dsv4.checks.catalogue")}


def floor(module: str) -> int:
    return max(i for i, names in enumerate(FLOORS) for n in names
               if module == n or (n != "dsv4" and module.startswith(n + ".")))


def test_a_module_imports_only_its_own_floor_and_the_floors_below():
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                 if d in MODULES and floor(d) > floor(m) and (m, d) not in REACHES_UP)
    assert not bad, f"imports that reach a floor above: {bad}"
    for m, deps in GRAPH.items():
        if m.startswith(("dsv4.kernels", "dsv4.strategies", "dsv4.components")):
            assert not deps & {"hydra", "omegaconf"}, f"{m} imports Hydra"


def test_the_top_level_is_folders_and_no_two_modules_share_a_name():
    """At most a dozen modules directly under dsv4/; a module's stem names one thing in the package (an
    option's module, named by its option in its group's folder, may repeat another group's option name)."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top
    stems: dict[str, list[str]] = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT)
        if p.stem == "__init__" or (rel.parts[0] == "strategies" and len(rel.parts) > 2):
            continue
        stems.setdefault(p.stem, []).append(str(rel))
    assert not {s: ps for s, ps in stems.items() if len(ps) > 1}


def test_the_kernels_are_folders_by_family():
    """dsv4/kernels/: a folder per family (sparse MQA, the front and caches, the indexer, the products) and,
    beside them, only what every family uses (the target, the launcher, rounding, the compile check)."""
    kernels = ROOT / "kernels"
    assert {p.name for p in kernels.iterdir() if p.is_dir() and not p.name.startswith("__")} == {
        "mqa", "front", "indexer", "products"}
    assert {p.stem for p in kernels.glob("*.py")} == {"__init__", "target", "launch", "rounding", "compile_check"}


def test_each_option_is_a_module_of_its_groups_folder_that_no_other_strategy_imports():
    """strategies/<group>/<option>.py (a nested group's: strategies/<group>/<nested>/<option>.py): an option's
    class lives in its group's folder, and what options share lives in a module of its own (dsv4/formats/, a
    group's common module), never in another option's."""
    from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS, defaults, options

    homes = {g: {type(o).__module__ for o in options(g).values()} for g in GROUPS}
    for g, mods in homes.items():
        assert all(m.startswith(f"dsv4.strategies.{g}.") and m.count(".") == 3 for m in mods), (g, mods)
    for g in NESTED_GROUPS:            # a nested group's options: strategies/<group>/<nested>/<option>.py
        mods = {type(o).__module__ for o in options(g).values()}
        assert all(m.startswith(f"dsv4.strategies.{g}.") and m.count(".") == 4 for m in mods), (g, mods)
    option_modules = set().union(*homes.values(), *({type(o).__module__ for o in options(g).values()}
                                                     for g in NESTED_GROUPS))
    # the one exception: an option's field that holds a nested group's option defaults to that group's
    # default option (an indexer option's `top_k`), whose module it imports for that default
    default_of_nested = {type(options(g)[defaults()[g]]).__module__ for g in NESTED_GROUPS}
    for m, deps in GRAPH.items():
        if m.startswith("dsv4.strategies."):
            allowed = default_of_nested if m.startswith(tuple(f"dsv4.strategies.{g.split('.')[0]}."
                                                                 for g in NESTED_GROUPS)) else set()
            bad = sorted(d for d in deps if d in option_modules and d != m and d not in allowed)
            assert not bad, f"{m} imports the option modules {bad}"


def test_the_layer_types_are_one_table_below_everything():
    """dsv4/values/layer_types.py is pure data that imports nothing of ours, and no module but it spells a ratio's
    facts as literals: which ratio has a compressor or an indexer (a ratio compared with 1, 4 or 128), how a
    compressor's windows overlap, or the indexer's pages by their ratio (`entries[4]`)."""
    import re

    assert not [d for d in GRAPH["dsv4.values.layer_types"] if d.startswith("dsv4")]
    facts = re.compile(r"\b(R|r|ratio|\w+_ratio\(\w*\))\s*(==|!=|>|<=|<|>=)\s*(1|4|128)\b"
                       r"|\b(entries|state)\[4\]|\b2 if \w*ratio\w* == 4|\bin \((0, )?4, 128\)")
    for m, path in MODULES.items():
        if m in ("dsv4.values.layer_types", "dsv4.oracle"):        # the oracle restates the published math itself
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not facts.search(line.split("#")[0]), f"{path.name}:{n}: {line.strip()}"


def test_strategies_never_import_components():
    """The strategies see the layer's components only through the seam's values (dsv4/values/seam.py), never by
    importing dsv4/components/ (type-checking imports included)."""
    for m, deps in GRAPH.items():
        if m.startswith("dsv4.strategies") or m == "dsv4.values.seam":
            bad = sorted(d for d in deps if d.startswith("dsv4.components"))
            assert not bad, f"{m} imports {bad}"


def test_the_cuda_graphs_use_the_engine_only_through_their_interface():
    """dsv4/components/graphs.py reads of its `engine` only the members of its `GraphedEngine` Protocol -- never
    the Engine's pools, layers or spec -- and the Engine has each of them."""
    def classdef(path: Path, name: str) -> ast.ClassDef:
        return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)

    graphs = ROOT / "components" / "graphs.py"
    proto = classdef(graphs, "GraphedEngine")
    allowed = {n.name for n in proto.body if isinstance(n, ast.FunctionDef)} \
        | {n.target.id for n in proto.body if isinstance(n, ast.AnnAssign)}
    read = {(n.attr, n.lineno) for n in ast.walk(ast.parse(graphs.read_text()))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "engine"}
    assert read and not [r for r in read if r[0] not in allowed], \
        f"graphs.py reads of the engine, beside GraphedEngine's members: {sorted(r for r in read if r[0] not in allowed)}"
    engine = classdef(ROOT / "components" / "engine.py", "Engine")
    has = {n.name for n in engine.body if isinstance(n, ast.FunctionDef)} \
        | {t.attr for n in ast.walk(engine) if isinstance(n, ast.Assign) for e in n.targets
           for t in (e.elts if isinstance(e, ast.Tuple) else [e])
           if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert allowed <= has, f"GraphedEngine members the Engine lacks: {sorted(allowed - has)}"



def test_the_configs_are_a_top_level_folder_that_the_package_installs_as_its_own():
    """configs/ at the repository's top level, one folder per group and preset kind, installed as the package
    dsv4.configs (pyproject.toml maps the folder): a checkout installed with -e and the wheel read one tree."""
    import importlib.util
    import tomllib

    repo = ROOT.parent
    assert not (ROOT / "configs").exists()
    groups = {p.name for p in (repo / "configs").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert {"backend", "model", "deployment", "workload", "experiment", "mqa_kernel", "o_proj", "head_padding",
            "cache_layout", "indexer", "linear"} == groups
    assert Path(next(iter(importlib.util.find_spec("dsv4.configs").submodule_search_locations))) == repo / "configs"
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"dsv4.configs": "configs"}
    packages = {module_name(p.parent) for p in ROOT.rglob("__init__.py")} | {"dsv4.configs"}
    assert set(setuptools["packages"]) == packages, sorted(set(setuptools["packages"]) ^ packages)


LONGEST_FUNCTION = 60       # lines, from `def` to its last line, docstring included


def test_no_function_outside_the_kernels_is_longer_than_a_screen():
    """Every function and method of dsv4/ but the kernels (whose launch wrappers follow their kernels'
    arguments) fits a screen: a longer one does several jobs, each of which wants a name."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {LONGEST_FUNCTION} lines: {long}"


def test_no_module_outside_the_strategies_names_an_option():
    """An option's class is named only in dsv4/strategies/ (its module, the package's re-exports); everywhere
    else options are reached through the catalogue (configs/: a group's default is configs/config.yaml's,
    `catalogue.default_option`, `catalogue.strategies`), so that a default is written once, and the layer, its
    pool and check() take one container of them (dsv4.strategies.Strategies, catalogue.GROUPS its fields).
    Exempt: dsv4/speed/, whose benchmarks measure named kernels (the record every MQA kernel reads, fp8 sim
    beside the vendors' products), and the tests, which pin the reference options they compare with."""
    from dataclasses import fields

    from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS, options
    from dsv4.strategies.choice import Strategies

    assert tuple(f.name for f in fields(Strategies)) == GROUPS
    chosen = [type(o) for g in GROUPS + NESTED_GROUPS for o in options(g).values()]
    option_modules, option_classes = {c.__module__ for c in chosen}, {c.__name__ for c in chosen}
    bad = []
    for m, path in MODULES.items():
        if m.startswith(("dsv4.strategies", "dsv4.speed")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{m}: import {a.name}" for a in node.names if a.name in option_modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
                    "dsv4.strategies"):
                bad += [f"{m}: from {node.module} import {a.name}" for a in node.names
                        if node.module in option_modules or a.name in option_classes
                        or f"{node.module}.{a.name}" in option_modules]
    assert not bad, f"option modules or classes named outside dsv4/strategies/: {bad}"


def _row_code_literals(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that give a row format (or a RowCode member's name) an int of their own: a dict
    literal mapping one to an int, or a constant of that name set to an int (`tl.constexpr(1)` included)."""
    def int_literal(node) -> bool:
        if isinstance(node, ast.Call) and len(node.args) == 1:
            node = node.args[0]
        return isinstance(node, ast.Constant) and type(node.value) is int

    def named(node) -> bool:
        return getattr(node, "id", None) in names or getattr(node, "attr", None) in names

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            lines += [node.lineno for k, v in zip(node.keys, node.values) if k is not None and named(k)
                      and int_literal(v)]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                tuples = isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple)
                pairs = zip(t.elts, node.value.elts) if tuples else [(t, node.value)]
                lines += [node.lineno for target, value in pairs if named(target) and int_literal(value)]
    return sorted(set(lines))


def test_the_kernels_row_codes_are_one_table():
    """The int a kernel takes for a row format is its RowFormat.code, from the one table in
    dsv4/formats/row_format.py (RowCode): no other module numbers the row formats itself."""
    from dsv4.formats import row_format

    names = {n for n, v in vars(row_format).items() if isinstance(v, row_format.RowFormat)}
    names |= {c.name for c in row_format.RowCode}
    assert _row_code_literals("LAYOUT_CODES = {BF16_ROWS: 0, FP8_DS_MLA: 1}\nFP8_KEY = tl.constexpr(5)", names) \
        == [1, 2], "the rule finds what it is for"
    bad = [f"{path.relative_to(ROOT)}:{n}" for m, path in MODULES.items() if m != "dsv4.formats.row_format"
           for n in _row_code_literals(path.read_text(), names)]
    assert not bad, f"row formats numbered outside dsv4/formats/row_format.py: {bad}"


def _device_reads(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every `.is_cuda` read in the file ('' at module level)."""
    out = []

    def visit(node, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            out.append((where, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text()), "")
    return out


def kernels_choices(source: str) -> list[str]:
    """Where `source` takes a `kernels` argument or compares a `kernels` value with None (line, function)."""
    def kernels(node) -> bool:
        return getattr(node, "id", None) == "kernels" or getattr(node, "attr", None) == "kernels"

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(kernels(s) for s in sides) and any(isinstance(s, ast.Constant) and s.value is None for s in sides):
                out.append(f"{node.lineno}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            if any(x.arg == "kernels" for x in a.posonlyargs + a.args + a.kwonlyargs):
                out.append(f"{node.lineno} ({node.name})")
    return out


def test_the_layer_is_handed_its_ops_not_a_target_it_compares_with_none():
    """The layer's own pieces run the ops the layer chose once when it was built (dsv4/components/layer_ops.py:
    the torch code or our Triton kernels): no function of dsv4/components takes a `kernels` value, and none
    compares one with None to pick its implementation on each call."""
    assert kernels_choices("def f(x, *, kernels=None):\n    if self.kernels is not None:\n        pass\n") == [
        "1 (f)", "2"], "the rule finds what it is for"
    bad = [f"{p.name}:{where}" for p in sorted((ROOT / "components").glob("*.py"))
           for where in kernels_choices(p.read_text())]
    assert not bad, f"`kernels` taken or compared with None in dsv4/components: {bad}"


def test_no_strategy_or_component_picks_its_implementation_by_a_tensors_device():
    """No `.is_cuda` read in dsv4/components or dsv4/strategies: an implementation is chosen once where the
    device is known (a `prepare`, the layer's build, a cache layout's `access` when its PagedCache is made),
    not per call by asking a tensor where it lives."""
    assert _device_reads(ROOT / "kernels" / "target.py"), "the rule finds what it is for"
    bad = [f"{folder}/{p.relative_to(ROOT / folder).as_posix()}:{n} ({where or 'module level'})"
           for folder in ("components", "strategies") for p in sorted((ROOT / folder).rglob("*.py"))
           for where, n in _device_reads(p)]
    assert not bad, f".is_cuda read to pick an implementation: {bad}"


def test_every_triton_kernel_is_a_programmatic_dependent():
    """Each of our Triton kernels takes part in programmatic dependent launch (Target.pdl, docs/design.md): it
    has a PDL constexpr and waits for the kernel before it (`dependent_start(PDL)`, or its own `gdc_wait`
    under PDL after a prologue that reads nothing the previous kernel writes). Gluon's are not Triton's."""
    missing = []
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.endswith("_kernel"):
                continue
            if not any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            body = ast.unparse(node)
            if "PDL" not in [a.arg for a in node.args.args] or not (
                    "dependent_start(PDL)" in body or ("gdc_wait()" in body and "if PDL" in body)):
                missing.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not missing, missing
