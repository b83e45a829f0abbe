"""The one-way layers of keras_vmoe, checked from the source's imports.

Every `import` and `from ... import` in keras_vmoe counts, those inside
functions (lazy imports) included. The rules (README, "Architecture"):

Modules named by string for a lazy import (the `lazy_exports` tables of
the package faces, `importlib.import_module`) count too:
each such string names an existing module.

* a module imports only modules of its own layer or of lower layers
  (`LAYERS`, bottom to top), but for the imports written out in `UPWARD`;
  nothing goes up by a string;
* no library module imports the command line (`keras_vmoe.cli`);
* no module is an alias of another (no shims for old import paths: the
  package was never released with them);
* the format readers/writers import neither Keras nor any keras_vmoe module
  but `budget`; JAX and TensorFlow only inside the functions whose
  libraries need them (Orbax's restore, `tf.io.gfile` for gs://);
* no import circles between modules;
* `importlib.import_module` only in the lazy package faces.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "keras_vmoe"

# Bottom to top. Each layer is whole folders (packages) of keras_vmoe, or
# top-level modules; a module belongs to the layer of its folder.
LAYERS = (
    ("base", ("keras_vmoe", "keras_vmoe.utils")),
    ("formats", ("keras_vmoe.formats",)),
    # The preset catalog: JSON data and name lookups, read by the conversion
    # for the released configs' routing and by the presets.
    ("catalog", ("keras_vmoe.catalog",)),
    ("keras helpers", ("keras_vmoe.distribution", "keras_vmoe.preprocessing",
                       "keras_vmoe.data")),
    ("layers", ("keras_vmoe.layers",)),
    ("deploy", ("keras_vmoe.deploy",)),
    ("models", ("keras_vmoe.models",)),
    ("conversion", ("keras_vmoe.conversion",)),
    ("presets", ("keras_vmoe.presets",)),
    ("training and evaluation", ("keras_vmoe.training", "keras_vmoe.evaluation")),
    ("command line", ("keras_vmoe.cli",)),
)
# Where `importlib.import_module` may appear: the lazy faces, and
# `extras.require`, which imports optional third-party packages by name.
IMPORTLIB_ALLOWED = ("keras_vmoe", "keras_vmoe.utils.lazy", "keras_vmoe.cli",
                     "keras_vmoe.utils.extras")
# The only imports that go up the layers, each an explicit import inside the
# method that needs it (never by a string): a model's `from_preset` and
# `save_to_preset` (the class-owned preset API, KerasHub's form) are
# implemented by the presets, which sit above the models because a released
# preset is converted from its upstream checkpoint on first use.
UPWARD = {
    ("keras_vmoe.models.model_base", "keras_vmoe.presets.load"),
    ("keras_vmoe.models.model_base", "keras_vmoe.presets.save"),
}
# Calls that import a module named by a string.
_BY_NAME_CALLS = ("lazy_exports", "import_module")


def _modules():
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _resolve(name):
    """The keras_vmoe module that an imported name lives in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path):
    """`(imported module, line, inside a function)` of every import."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:
                    candidate = f"{child.module}.{alias.name}"
                    target = (candidate if _resolve(candidate) == candidate
                              else child.module)
                    found.append((target, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def _docstrings(tree):
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _imports_by_name(path):
    """`(string, line)` of each keras_vmoe module path written as a string in a
    module that imports by name (`_BY_NAME_CALLS`): the lazy import targets."""
    tree = ast.parse(path.read_text())
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else
             getattr(node.func, "id", None)
             for node in ast.walk(tree) if isinstance(node, ast.Call)}
    if not calls & set(_BY_NAME_CALLS):
        return []
    docstrings = _docstrings(tree)
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings
            and re.fullmatch(r"keras_vmoe(\.\w+)+", node.value)]


def _is_under(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _is_under(module, prefix) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _internal_edges(by_name=True):
    """`(module, imported module, line, lazy)`: the import statements, and
    (`by_name`) the modules named for a lazy import; not the `UPWARD` ones."""
    for module, path in sorted(MODULES.items()):
        for target, line, lazy in _imports(path):
            if target.startswith("keras_vmoe") and (module, _resolve(target)) not in UPWARD:
                yield module, _resolve(target), line, lazy
        if by_name:
            for target, line in _imports_by_name(path):
                if target != module:
                    yield module, _resolve(target), line, True


def _folder(module):
    """`keras_vmoe.X` for a module under keras_vmoe (the root for itself)."""
    return ".".join(module.split(".")[:2])


def test_layers_name_whole_folders():
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            assert prefix == _folder(prefix), (
                f"{prefix}: a layer names a whole folder or top-level module")


def test_no_circles_between_folders():
    graph = {}
    for module, target, _, _ in _internal_edges():
        a, b = _folder(module), _folder(target)
        if a != b and a != "keras_vmoe" and b != "keras_vmoe":
            graph.setdefault(a, set()).add(b)

    def reaches(start, goal, seen=()):
        return start == goal or any(
            reaches(n, goal, (*seen, start)) for n in graph.get(start, ())
            if n not in seen)

    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not circles, "folders that import each other:\n" + "\n".join(circles)


def test_the_package_root_holds_only_its_face():
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert not loose, (
        f"modules at the package root: {loose}; a helper goes to keras_vmoe/utils/ "
        "or to the folder that uses it")


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules without a layer in LAYERS: {missing}"


def test_imports_go_down_the_layers():
    upward = []
    for module, target, line, _ in _internal_edges():
        if target == module:
            continue
        if layer_of(target) is not None and layer_of(target) > layer_of(module):
            upward.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: "
                          f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                          f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_no_library_module_imports_the_command_line():
    bad = [f"{module} imports {target} (line {line})"
           for module, target, line, _ in _internal_edges()
           if not _is_under(module, "keras_vmoe.cli")
           and _is_under(target, "keras_vmoe.cli")]
    assert not bad, bad


def test_lazy_import_targets_name_existing_modules():
    """A lazy face's table or `import_module` names modules
    by string: each must exist (a moved module is found here, not by a user)."""
    named = {(module, target, line) for module, path in MODULES.items()
             for target, line in _imports_by_name(path)}
    assert any(target == "keras_vmoe.presets.load" for _, target, _ in named), named
    missing = sorted(f"{module}:{line} names {target}" for module, target, line in named
                     if target not in MODULES)
    assert not missing, "lazy import targets that are not modules: " + ", ".join(missing)
    written = {(module, _resolve(target)) for module, path in MODULES.items()
               for target, _, lazy in _imports(path) if lazy}
    assert UPWARD <= written, f"UPWARD entries no module makes: {UPWARD - written}"


def test_the_graph_has_the_lazy_imports_by_name():
    edges = {(module, target) for module, target, _, _ in _internal_edges()}
    assert ("keras_vmoe.presets", "keras_vmoe.presets.upcycling") in edges
    assert ("keras_vmoe.distribution", "keras_vmoe.distribution.layouts") in edges
    assert ("keras_vmoe.cli", "keras_vmoe.cli.convert_cmd") in edges


# Signs of a compatibility shim: an old path that aliases a module or warns
# that a name moved. keras_vmoe was never released with old paths to keep.
SHIM_MARKERS = ("alias_module(", "deprecated_exports(", "warn_renamed(", "call_moved(",
                "DeprecationWarning", "sys.modules[__name__]")


def _shim_markers(path):
    text = path.read_text()
    found = [marker for marker in SHIM_MARKERS if marker in text]
    tree = ast.parse(text)
    for node in ast.walk(tree):
        # `sys.modules[...] = ...`: a module standing in for another.
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute)
                and t.value.attr == "modules" for t in node.targets):
            found.append(f"sys.modules[...] = (line {node.lineno})")
    return found


def _is_reexport_only(path):
    """A module (not a package face or `__main__`) that only imports names and
    lists them."""
    if path.name in ("__init__.py", "__main__.py"):
        return False
    tree = ast.parse(path.read_text())
    body = [node for node in tree.body if node.lineno not in _docstring_lines(tree)]
    return bool(body) and all(
        isinstance(node, (ast.Import, ast.ImportFrom))
        or (isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
        or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call))
        for node in body)


def _docstring_lines(tree):
    first = tree.body[0] if tree.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return {first.lineno}
    return set()


def test_no_module_is_a_shim():
    shims = [f"{MODULES[m].relative_to(ROOT.parent)}: {found}" for m in sorted(MODULES)
             if (found := _shim_markers(MODULES[m]))]
    shims += [f"{MODULES[m].relative_to(ROOT.parent)}: only re-exports" for m in sorted(MODULES)
              if _is_reexport_only(MODULES[m])]
    assert not shims, "compatibility shims (import from the module itself):\n" + "\n".join(shims)


def test_the_shim_check_sees_a_planted_shim(tmp_path):
    alias = tmp_path / "old.py"
    alias.write_text('"""Old path."""\n\nfrom keras_vmoe.utils import alias_module\n\n'
                     'alias_module(__name__, "keras_vmoe.new")\n')
    assert "alias_module(" in _shim_markers(alias) and _is_reexport_only(alias)
    swap = tmp_path / "swap.py"
    swap.write_text("import sys\n\nimport keras_vmoe.new as new\n\nsys.modules[__name__] = new\n")
    assert any("sys.modules" in found for found in _shim_markers(swap))
    reexport = tmp_path / "moved.py"
    reexport.write_text('"""Moved."""\n\nfrom keras_vmoe.formats.vit_npz import read\n\n'
                        '__all__ = ["read"]\n')
    assert _is_reexport_only(reexport) and not _shim_markers(reexport)
    real = tmp_path / "real.py"
    real.write_text("import os\n\n\ndef f():\n    return os.sep\n")
    assert not _is_reexport_only(real) and not _shim_markers(real)


def test_formats_need_no_keras():
    bad = []
    for module, path in MODULES.items():
        if not _is_under(module, "keras_vmoe.formats"):
            continue
        for target, line, lazy in _imports(path):
            top = target.split(".")[0]
            if top in ("keras", "flax") or (top in ("jax", "tensorflow") and not lazy) or (
                top == "keras_vmoe" and not _is_under(target, "keras_vmoe.formats")
                and target not in ("keras_vmoe.utils.memory_budget", "keras_vmoe.utils.safe_files",
                                   "keras_vmoe.utils.validation")
            ):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, bad


def test_no_import_circles():
    graph = {}
    for module, target, _, _ in _internal_edges():
        if target != module:
            # A package's __init__ runs before its submodules: importing a
            # submodule of one's own package is not a circle through it.
            graph.setdefault(module, set()).add(target)
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if _is_under(node, nxt):  # a module importing its own package
                continue
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_importlib_only_in_lazy_faces():
    bad = []
    for module, path in MODULES.items():
        if module in IMPORTLIB_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                bad.append(f"{module}:{node.lineno}")
    assert not bad, f"importlib detours outside the lazy faces: {bad}"


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The rules fail on a planted upward import (the test can fail)."""
    planted = tmp_path / "keras_vmoe" / "formats"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text("def f():\n    from keras_vmoe.cli import main\n")
    edges = [(t, lazy) for t, _, lazy in _imports(planted / "bad.py")]
    assert edges == [("keras_vmoe.cli", True)]
    assert layer_of("keras_vmoe.cli") > layer_of("keras_vmoe.formats.bad")


FACES = ("conversion", "data", "deploy", "distribution", "evaluation",
         "formats", "layers", "models", "preprocessing", "presets", "training")


def test_the_public_surface_stays_small():
    import importlib

    counts = {face: len(importlib.import_module(f"keras_vmoe.{face}").__all__)
              for face in FACES}
    assert counts["distribution"] <= 10, counts
    assert sum(counts.values()) <= 110, counts


# Imports of keras_vmoe modules inside functions: only those that keep Keras,
# JAX or TensorFlow out of a light import (`import keras_vmoe`, the CLI's
# start-up, `keras_vmoe.data`, ...), each saying so with a `# lazy:` comment.
MAX_LAZY_IMPORTS = 60


def _lazy_internal_imports(path):
    """`(line, statement text)` of each function-level keras_vmoe import."""
    source = path.read_text()
    lines = source.splitlines()
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            internal = (
                isinstance(child, ast.ImportFrom)
                and (child.level > 0 or (child.module or "").startswith("keras_vmoe"))
            ) or (isinstance(child, ast.Import)
                  and any(a.name.startswith("keras_vmoe") for a in child.names))
            if in_function and internal:
                text = "\n".join(lines[child.lineno - 1:child.end_lineno])
                found.append((child.lineno, text))
            visit(child, nested)

    visit(ast.parse(source), False)
    return found


def test_function_level_imports_are_few_and_say_why():
    lazy = [(MODULES[m].relative_to(ROOT.parent), line, text)
            for m in sorted(MODULES)
            for line, text in _lazy_internal_imports(MODULES[m])]
    assert len(lazy) <= MAX_LAZY_IMPORTS, (
        f"{len(lazy)} function-level keras_vmoe imports (at most "
        f"{MAX_LAZY_IMPORTS}): import at module top unless it must be lazy")
    unexplained = [f"{path}:{line}" for path, line, text in lazy if "# lazy:" not in text]
    assert not unexplained, (
        "function-level imports without a `# lazy: <why>` comment: " + ", ".join(unexplained))


def test_the_lazy_import_check_sees_an_unexplained_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n\n\ndef f():\n    from keras_vmoe import models\n\n\n"
                       "def g():\n    from keras_vmoe import data  # lazy: why\n")
    found = _lazy_internal_imports(planted)
    assert [line for line, _ in found] == [5, 9]
    assert ["# lazy:" in text for _, text in found] == [False, True]


# A function longer than this is split along the sections its comments name.
MAX_FUNCTION_LINES = 80


def _code_lines(function, lines):
    """Lines holding statements of `function`: no docstring, comments or blanks."""
    body = function.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    numbers = set()
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.stmt):
                numbers.update(range(node.lineno, node.end_lineno + 1))
    return sum(1 for n in numbers
               if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def _long_functions(path):
    source = path.read_text()
    lines = source.splitlines()
    return [(node.lineno, node.name, _code_lines(node, lines))
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _code_lines(node, lines) > MAX_FUNCTION_LINES]


def test_no_function_is_over_80_code_lines():
    long = [f"{MODULES[m].relative_to(ROOT.parent)}:{line} {name} ({count} lines)"
            for m in sorted(MODULES) for line, name, count in _long_functions(MODULES[m])]
    assert not long, "functions over 80 code lines: " + ", ".join(long)


def test_the_function_length_check_counts_code_not_comments(tmp_path):
    planted = tmp_path / "planted.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(81))
    planted.write_text('def long():\n    """Doc."""\n' + body
                       + 'def short():\n    """Doc.\n\n    More.\n    """\n'
                       + "    # a comment\n\n" * 90 + "    return 1\n")
    assert _long_functions(planted) == [(1, "long", 81)]


# The package's size budget (every .py line, docstrings and blanks included):
# a feature that needs more makes room by simplifying what is there.
MAX_PACKAGE_LINES = 28_000
# A module docstring is a summary (a command's is its --help text); longer
# design notes go to docs/internals.md.
MAX_MODULE_DOCSTRING_LINES = 25


def _module_docstring_lines(path):
    tree = ast.parse(path.read_text())
    first = tree.body[0] if tree.body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return first.end_lineno - first.lineno + 1
    return 0


def test_the_package_stays_within_its_line_budget():
    total = sum(len(path.read_text().splitlines()) for path in MODULES.values())
    assert total <= MAX_PACKAGE_LINES, (
        f"keras_vmoe/ has {total:,} lines, over its budget of {MAX_PACKAGE_LINES:,}")


def test_module_docstrings_are_summaries():
    long = [f"{MODULES[m].relative_to(ROOT.parent)} ({n} lines)"
            for m in sorted(MODULES)
            if (n := _module_docstring_lines(MODULES[m])) > MAX_MODULE_DOCSTRING_LINES]
    assert not long, ("module docstrings over "
                      f"{MAX_MODULE_DOCSTRING_LINES} lines (move the notes to "
                      "docs/internals.md): " + ", ".join(long))


def test_the_docstring_check_counts_the_module_docstring(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Summary.\n\nMore.\n"""\n\n\ndef f():\n    """Not counted."""\n')
    assert _module_docstring_lines(planted) == 4
    planted.write_text("x = 1\n")
    assert _module_docstring_lines(planted) == 0
