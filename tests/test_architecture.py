"""The one-way layers of keras_vmoe, checked from the source's imports.

Every `import` and `from ... import` in keras_vmoe counts, those inside
functions (lazy imports) included. The rules (README, "Architecture"):

* a module imports only modules of its own layer or of lower layers
  (`LAYERS`, bottom to top);
* no library module imports the command line (`keras_vmoe.cli`) or a
  deprecated alias (`keras_vmoe.checkpoints`, `keras_vmoe.presets.api`);
* the format readers/writers import neither Keras nor any keras_vmoe module
  but `budget`; JAX and TensorFlow only inside the functions whose
  libraries need them (Orbax's restore, `tf.io.gfile` for gs://);
* no import circles between modules;
* `importlib.import_module` only in the lazy package faces.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "keras_vmoe"

# Bottom to top. Each layer is whole folders (packages) of keras_vmoe, or
# top-level modules; a module belongs to the layer of its folder.
LAYERS = (
    ("base", ("keras_vmoe", "keras_vmoe._lazy", "keras_vmoe.memory_budget",
              "keras_vmoe.malloc_tuning", "keras_vmoe.keras_internals",
              "keras_vmoe.utils", "keras_vmoe.safe_files", "keras_vmoe.extras",
              "keras_vmoe.backend_support")),
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
# Old import paths kept for users (each warns); no library module may use them.
ALIASES = ("keras_vmoe.checkpoints", "keras_vmoe.presets.api",
           "keras_vmoe.presets.catalog", "keras_vmoe.presets.names",
           "keras_vmoe.distribution.plan", "keras_vmoe.training.recipe",
           "keras_vmoe.allocator", "keras_vmoe.budget", "keras_vmoe.layers.sizes",
           "keras_vmoe.models.size")
# Where `importlib.import_module` may appear: the lazy faces, and
# `extras.require`, which imports optional third-party packages by name.
IMPORTLIB_ALLOWED = ("keras_vmoe", "keras_vmoe._lazy", "keras_vmoe.cli", "keras_vmoe.extras",
                     "keras_vmoe.utils.deprecation")


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


def _is_under(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _is_under(module, prefix) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _internal_edges():
    for module, path in sorted(MODULES.items()):
        for target, line, lazy in _imports(path):
            if target.startswith("keras_vmoe"):
                yield module, _resolve(target), line, lazy


def _is_alias(module):
    return any(_is_under(module, alias) for alias in ALIASES)


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
        if _is_alias(module) or _is_alias(target):
            continue
        a, b = _folder(module), _folder(target)
        if a != b and a != "keras_vmoe" and b != "keras_vmoe":
            graph.setdefault(a, set()).add(b)

    def reaches(start, goal, seen=()):
        return start == goal or any(
            reaches(n, goal, (*seen, start)) for n in graph.get(start, ())
            if n not in seen)

    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not circles, "folders that import each other:\n" + "\n".join(circles)


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None and not _is_alias(m)]
    assert not missing, f"modules without a layer in LAYERS: {missing}"


def test_imports_go_down_the_layers():
    upward = []
    for module, target, line, _ in _internal_edges():
        if _is_alias(module) or target == module:
            continue
        if layer_of(target) is not None and layer_of(target) > layer_of(module):
            upward.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: "
                          f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                          f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that go up the layers:\n" + "\n".join(upward)


def test_no_library_module_imports_the_command_line_or_an_alias():
    bad = [f"{module} imports {target} (line {line})"
           for module, target, line, _ in _internal_edges()
           if not _is_alias(module) and not _is_under(module, "keras_vmoe.cli")
           and (_is_under(target, "keras_vmoe.cli") or _is_alias(target))]
    assert not bad, bad


def test_formats_need_no_keras():
    bad = []
    for module, path in MODULES.items():
        if not _is_under(module, "keras_vmoe.formats"):
            continue
        for target, line, lazy in _imports(path):
            top = target.split(".")[0]
            if top in ("keras", "flax") or (top in ("jax", "tensorflow") and not lazy) or (
                top == "keras_vmoe" and not _is_under(target, "keras_vmoe.formats")
                and target not in ("keras_vmoe.memory_budget", "keras_vmoe.safe_files",
                                   "keras_vmoe._lazy", "keras_vmoe.utils.deprecation",
                                   "keras_vmoe.utils.validation")
            ):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, bad


def test_no_import_circles():
    graph = {}
    for module, target, _, _ in _internal_edges():
        if target != module and not _is_alias(module):
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
        if module in IMPORTLIB_ALLOWED or _is_alias(module):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                bad.append(f"{module}:{node.lineno}")
    assert not bad, f"importlib detours outside the lazy faces: {bad}"


def test_old_module_paths_warn_and_give_the_new_module():
    import subprocess
    import sys

    script = """
import importlib, sys, warnings
warnings.simplefilter("always")
import keras_vmoe
# The top package's lazily exported submodule under its old name (a first
# import of `keras_vmoe.allocator`, so it warns).
with warnings.catch_warnings(record=True) as caught:
    assert keras_vmoe.allocator is importlib.import_module("keras_vmoe.malloc_tuning")
assert any("keras_vmoe.allocator" in str(w.message) and "keras_vmoe.malloc_tuning"
           in str(w.message) for w in caught), [str(w.message) for w in caught]
assert "allocator" not in keras_vmoe.__all__ and "malloc_tuning" in keras_vmoe.__all__
old = {"keras_vmoe.distribution.plan": "keras_vmoe.training.memory_plan",
       "keras_vmoe.presets.catalog": "keras_vmoe.catalog",
       "keras_vmoe.presets.names": "keras_vmoe.catalog.names",
       "keras_vmoe.checkpoints.vit_npz": "keras_vmoe.formats.vit_npz",
       "keras_vmoe.checkpoints.partitioned": "keras_vmoe.formats.partitioned",
       "keras_vmoe.checkpoints.train_state": "keras_vmoe.formats.train_state",
       "keras_vmoe.checkpoints.infer": "keras_vmoe.conversion.infer",
       "keras_vmoe.training.recipe": "keras_vmoe.training.finetuning",
       "keras_vmoe.budget": "keras_vmoe.memory_budget",
       "keras_vmoe.layers.sizes": "keras_vmoe.layers.symbolic_sizes",
       "keras_vmoe.models.size": "keras_vmoe.models.size_estimate"}
def deprecations(path):
    with warnings.catch_warnings(record=True) as caught:
        module = importlib.import_module(path)
    return module, [str(w.message) for w in caught if w.category is DeprecationWarning]
for path, new in old.items():
    module, messages = deprecations(path)
    assert module is importlib.import_module(new), path
    assert any(path in m and new in m and "0.4.0" in m for m in messages), (path, messages)
# Modules that keep the old names of code that moved (not one module).
kept = {"keras_vmoe.presets.api": "keras_vmoe.presets",
        "keras_vmoe.checkpoints": "keras_vmoe.formats",
        "keras_vmoe.checkpoints.convert": "keras_vmoe.conversion",
        "keras_vmoe.distribution.compat": "make_distribution"}
for path, new in kept.items():
    sys.modules.pop(path, None)
    module, messages = deprecations(path)
    assert any(f"`{path}`" in m and new in m and "0.4.0" in m for m in messages), (path, messages)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("path,name", [
    ("keras_vmoe.formats.partitioned", "restore_flat"),
    ("keras_vmoe.formats.train_state", "resolve_checkpoint"),
    ("keras_vmoe.formats.vit_npz", "read_shapes"),
    ("keras_vmoe.conversion.infer", "infer_architecture"),
    ("keras_vmoe.checkpoints.convert", "convert_to_preset"),
    ("keras_vmoe.checkpoints.convert", "build_model_from_upstream"),
    ("keras_vmoe.checkpoints", "save_checkpoint"),
    ("keras_vmoe.presets.api", "from_preset"),
    ("keras_vmoe.presets.api", "save_to_preset"),
    ("keras_vmoe.training.recipe", "finetune"),
    ("keras_vmoe.allocator", "restart_with_hugepages"),
    ("keras_vmoe.budget", "check_fits"),
    ("keras_vmoe.layers.sizes", "ceil_div"),
    ("keras_vmoe.models.size", "backbone_sizes"),
])
def test_old_import_paths_still_work(path, name):
    import importlib

    assert callable(getattr(importlib.import_module(path), name))


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The rules fail on a planted upward import (the test can fail)."""
    planted = tmp_path / "keras_vmoe" / "formats"
    planted.mkdir(parents=True)
    (planted / "bad.py").write_text("def f():\n    from keras_vmoe.cli import main\n")
    edges = [(t, lazy) for t, _, lazy in _imports(planted / "bad.py")]
    assert edges == [("keras_vmoe.cli", True)]
    assert layer_of("keras_vmoe.cli") > layer_of("keras_vmoe.formats.bad")


FACES = ("checkpoints", "conversion", "data", "deploy", "distribution", "evaluation",
         "formats", "layers", "models", "preprocessing", "presets", "training")


def test_the_public_surface_stays_small():
    import importlib

    counts = {face: len(importlib.import_module(f"keras_vmoe.{face}").__all__)
              for face in FACES}
    assert counts["distribution"] <= 10, counts
    assert sum(counts.values()) <= 110, counts


@pytest.mark.parametrize("face,name,module", [
    ("checkpoints", "MAGIC_KEY", "keras_vmoe.formats.partitioned"),
    ("checkpoints", "LeafInfo", "keras_vmoe.formats.partitioned"),
    ("checkpoints", "shard_path", "keras_vmoe.formats.partitioned"),
    ("evaluation", "top_k_accuracy", "keras_vmoe.evaluation.metrics"),
    ("evaluation", "kl_diversity", "keras_vmoe.evaluation.ensemble"),
    ("evaluation", "predict_log_probabilities", "keras_vmoe.evaluation.predictions"),
])
def test_helpers_left_the_package_faces(face, name, module):
    """Format constants and metric helpers are reached through their module;
    the package path still works, with a warning naming that module."""
    import importlib
    import re

    package = importlib.import_module(f"keras_vmoe.{face}")
    assert name not in package.__all__
    with pytest.warns(DeprecationWarning, match=re.escape(f"`{module}.{name}`")):
        value = getattr(package, name)
    assert value is getattr(importlib.import_module(module), name)


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
            for m in sorted(MODULES) if not _is_alias(m)
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
