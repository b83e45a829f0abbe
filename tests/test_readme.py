"""Every Python example of the documentation runs as printed, offline.

* The ```python blocks of each page (README.md and every page of `docs/`)
  run in one subprocess per page (8 virtual CPU devices via `XLA_FLAGS`, an
  empty Keras home, a temporary working directory, Internet connections
  refused), each block in a fresh namespace: a block must import what it
  uses. Blocks are found when the tests are collected, so sections and
  pages added later are checked too. The tests of one page share an
  `xdist_group`, so with `--dist loadgroup` each page runs once. A block
  fails when keras_vmoe's own code issues a warning while it runs: the
  documentation's examples run warning-free.
* Every `keras-vmoe ...` command of a page's ```bash blocks is parsed by
  the command line's own parser (a wrong flag or subcommand fails).
* The ```python blocks of docstrings in `keras_vmoe/` run the same way in
  another subprocess (tiny models; about two minutes on 2 cores).
* The `>>>` examples of docstrings run with `doctest` (in the module's
  namespace, as `python -m doctest` would).

Nothing is substituted. An example that cannot run offline (released
weights, a TPU) goes in a ```bash block or as commented lines. A README
block may be excluded only visibly, with the line
`<!-- readme-test: skip (reason) -->` right above its fence; the test then
reports it as skipped with that reason.
"""

import ast
import doctest
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from keras_vmoe.distribution.launch import xla_flags_for_cpu_devices

# Run by `.ci/run` as its own step (`pytest -m docs`): the README blocks and
# the docstring blocks take about two minutes each, which the default command
# leaves to CI.
pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_vmoe"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
_FENCE = re.compile(
    r"(?P<marker><!-- readme-test: skip \((?P<reason>[^)]*)\) -->\n)?"
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```",
    re.S | re.M,
)


def fenced_python(text):
    """(line number, code, skip reason or None) of each ```python block."""
    blocks = []
    for match in _FENCE.finditer(text):
        indent = match.group("indent")
        lines = match.group("code").splitlines()
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in lines)
        line = text.count("\n", 0, match.start("code")) + 1
        blocks.append((line, code + "\n", match.group("reason")))
    return blocks


def _docstrings(path):
    """(name, docstring, first line) of a module's module/class/function docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                expr = node.body[0]
                found.append((getattr(node, "name", "<module>"), doc, expr.lineno))
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _page_name(page):
    return str(page.relative_to(ROOT))


def page_blocks(page):
    """(where, code, skip reason) of every ```python block of a page."""
    name = _page_name(page)
    return [(f"{name}:{line}", code, reason)
            for line, code, reason in fenced_python(page.read_text(encoding="utf-8"))]


def readme_blocks():
    """(where, code, skip reason) of every ```python block of the README."""
    return page_blocks(README)


_BASH = re.compile(r"^(?P<indent>[ \t]*)```(?:bash|sh|console)[ \t]*\n(?P<code>.*?)^(?P=indent)```",
                   re.S | re.M)


def bash_commands(text):
    """The `keras-vmoe ...` commands of a text's ```bash blocks, as argv lists
    (continuation lines joined, comments and what follows `&&`/`|` dropped)."""
    import shlex

    commands = []
    for match in _BASH.finditer(text):
        code = match.group("code").replace("\\\n", " ")
        for line in code.splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(part, comments=True)
                except ValueError:
                    continue
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # VAR=value prefixes
                if words and words[0] == "keras-vmoe":
                    commands.append(words[1:])
    return commands


def inline_commands(text):
    """The `keras-vmoe ...` commands quoted inline (single backticks) in a
    text that give options: a bare subcommand name or a synopsis with
    placeholders (`{a,b}`, `..`) is a mention, not a command to run."""
    import shlex

    prose = _BASH.sub("", _FENCE.sub("", text)).replace("\n", " ")
    quoted = re.findall(r"(?<!`)`(keras-vmoe(?: [^`]*)?)`", prose)
    return [shlex.split(c)[1:] for c in quoted
            if " --" in c and not any(mark in c for mark in ("{", "..", "[", "|"))]


def docstring_blocks():
    """(where, code, None) of every ```python block of the package's docstrings."""
    blocks = []
    for _, path in _modules():
        for name, doc, lineno in _docstrings(path):
            for line, code, _ in fenced_python(doc):
                where = f"{path.relative_to(ROOT)}:{lineno + line}({name})"
                blocks.append((where, code, None))
    return blocks


def doctest_modules():
    return [module for module, path in _modules()
            if ">>>" in path.read_text(encoding="utf-8")]


README_BLOCKS = readme_blocks()
PAGE_BLOCKS = [(page, *block) for page in PAGES for block in page_blocks(page)]
DOCSTRING_BLOCKS = docstring_blocks()

# Runs each block in a fresh namespace; refuses Internet connections.
_RUNNER = r'''
import json, socket, sys, time, traceback, warnings

_connect = socket.socket.connect

def _offline_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        raise OSError(f"documentation examples must run offline: connect({address!r})")
    return _connect(self, address)

socket.socket.connect = _offline_connect

# The warnings keras_vmoe's own code issues: an example must run without any.
_warn, _warned = warnings.warn, []

def _recording_warn(message, category=None, stacklevel=1, *args, **kwargs):
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.split(".")[0] == "keras_vmoe":
        _warned.append(f"{caller}: {getattr(category, '__name__', 'UserWarning')}: "
                       f"{message}")
    return _warn(message, category, stacklevel + 1, *args, **kwargs)

warnings.warn = _recording_warn
blocks = json.load(open(sys.argv[1]))
results = {}
for where, code in blocks:
    start = time.perf_counter()
    _warned.clear()
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
        results[where] = None
        if _warned:
            results[where] = ("keras_vmoe warned (an example must run without a "
                              "warning):\n" + "\n".join(_warned))
    except BaseException:
        results[where] = traceback.format_exc(limit=8)
    if "keras" in sys.modules:  # a block's global distribution ends with it
        sys.modules["keras"].distribution.set_distribution(None)
        backend = sys.modules["keras"].config.backend()
        if results[where] is None and backend != "jax":
            results[where] = (f"ran on Keras' {backend!r} backend, not on JAX: "
                              "import keras_vmoe before keras, or set KERAS_BACKEND")
    status = "ok" if results[where] is None else "FAILED"
    print(f"{where}: {status} in {time.perf_counter() - start:.1f} s "
          f"(cpu {time.process_time():.1f} s so far)", flush=True)
json.dump(results, open(sys.argv[2], "w"))
'''


def run_blocks(blocks, work):
    """Runs blocks in one fresh interpreter; {where: None or traceback}.

    As on a new user's machine: no `KERAS_BACKEND` and no
    `~/.keras/keras.json` (`HOME` is a temporary folder). Blocks must run
    on JAX, keras_vmoe's default (the runner checks the backend after each
    block).
    """
    home = work / "home"
    home.mkdir(parents=True)
    # Examples say "from the root of the checkout" for the files it ships
    # (the upstream-format example under tests/data).
    (work / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    runnable = [(where, code) for where, code, reason in blocks if reason is None]
    (work / "blocks.json").write_text(json.dumps(runnable))
    (work / "runner.py").write_text(_RUNNER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_VMOE_CHECKPOINT_ROOT", "KERAS_BACKEND", "KERAS_HOME")}
    env.update(
        HOME=str(home),
        XLA_FLAGS=xla_flags_for_cpu_devices(8),
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        TF_CPP_MIN_LOG_LEVEL="3",
        # `malloc_tuning.restart_with_hugepages()` examples must not restart the
        # runner (it would re-run the blocks before them).
        KERAS_VMOE_NO_HUGEPAGES="1",
    )
    process = subprocess.run(
        [sys.executable, str(work / "runner.py"), str(work / "blocks.json"),
         str(work / "results.json")],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )
    if process.returncode != 0:
        pytest.fail(f"The example runner crashed:\n{process.stdout}\n{process.stderr}")
    return json.loads((work / "results.json").read_text())


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """{page: {where: None or traceback}}, each page run once, when first asked."""
    cache = {}

    def results(page):
        if page not in cache:
            cache[page] = run_blocks(page_blocks(page),
                                     tmp_path_factory.mktemp(page.stem))
        return cache[page]

    return results


@pytest.fixture(scope="module")
def docstring_results(tmp_path_factory):  # one process (xdist_group "docstrings")
    return run_blocks(DOCSTRING_BLOCKS, tmp_path_factory.mktemp("docstrings"))


def _check(results, where, code, reason):
    if reason is not None:
        pytest.skip(f"{where} is marked not to run: {reason}")
    error = results[where]
    assert error is None, f"{where} fails as printed:\n{code}\n{error}"


def test_readme_has_python_examples():
    assert len(README_BLOCKS) >= 3 and len(DOCSTRING_BLOCKS) >= 3
    # The extractor sees indented fences and skip markers.
    text = "x\n<!-- readme-test: skip (needs a TPU) -->\n```python\nA = 1\n```\n" \
           "  ```python\n  B = 2\n  ```\n"
    assert fenced_python(text) == [(4, "A = 1\n", "needs a TPU"), (7, "B = 2\n", None)]


def test_a_block_fails_when_keras_vmoe_warns(tmp_path):
    library = ("import warnings\n"
               "exec('import warnings\\nwarnings.warn(\"a routing note\")',"
               " {'__name__': 'keras_vmoe.deploy.export'})\n")
    results = run_blocks([("library", library, None),
                          ("user", "import warnings\nwarnings.warn('mine')\n", None)],
                         tmp_path)
    assert "keras_vmoe.deploy.export: UserWarning: a routing note" in results["library"]
    assert results["user"] is None


def test_examples_write_only_under_their_working_directory():
    # Examples run in parallel (README and docstring subprocesses) and again
    # on the next run: a fixed absolute path would be shared state (a stale
    # checkpoint resumes, two writers contend for one HDF5 file lock).
    absolute = re.compile(r"""["'](/tmp|/var/tmp|~)/""")
    offenders = [where for _, where, code, _ in PAGE_BLOCKS if absolute.search(code)]
    offenders += [where for where, code, _ in DOCSTRING_BLOCKS if absolute.search(code)]
    assert not offenders, f"examples with a fixed absolute path: {offenders}"


@pytest.mark.parametrize("page,where,code,reason", [
    pytest.param(*block, marks=pytest.mark.xdist_group(_page_name(block[0])))
    for block in PAGE_BLOCKS], ids=[b[1] for b in PAGE_BLOCKS])
def test_page_block_runs(page_results, page, where, code, reason):
    _check(page_results(page), where, code, reason)


def test_bash_commands_are_found():
    text = ("```bash\nKERAS_BACKEND=torch keras-vmoe predict a.png \\\n    --top-k 3  # x\n"
            "pip install . && keras-vmoe\n```\n```python\nkeras-vmoe no\n```\n")
    assert bash_commands(text) == [["predict", "a.png", "--top-k", "3"], []]


def _image_folder(path):
    """A two-class folder of images where a command names one (`--data DIR`)."""
    from PIL import Image

    for label in ("a", "b"):
        (path / label).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(path / label / "0.png")


def _unknown_presets(argv):
    """Preset names in a command (`--preset NAME`, `--from NAME`, `plan NAME`)
    that the catalog does not know; paths and placeholders (`P`) pass."""
    from keras_vmoe.catalog import names

    given = [value for flag, value in zip(argv, argv[1:], strict=False)
             if flag in ("--preset", "--from")]
    if argv[:1] == ["plan"] and len(argv) > 1:
        given.append(argv[1])
    return [name for name in given
            if not re.search(r"[/.\\]", name) and not name.isupper()
            and names.resolve_preset_name(name) is None]


def help_commands():
    """(subcommand, argv) of every `keras-vmoe ...` example line of the
    subcommands' `--help` texts (their module docstrings)."""
    from keras_vmoe import cli

    found = []
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a.choices, dict))
    for name, sub in sorted(subparsers.choices.items()):
        text = (sub.description or "").replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].split(" | ")[0].strip()
            words = line.split()
            # "keras-vmoe NAME: what it does" is the summary, not a command.
            if words[:1] == ["keras-vmoe"] and not words[1].endswith(":"):
                found.append((name, words[1:]))
    return found


def test_help_examples_parse_and_name_real_presets(tmp_path, monkeypatch):
    from keras_vmoe.cli import build_parser

    monkeypatch.chdir(tmp_path)
    commands = help_commands()
    assert len({name for name, _ in commands}) >= 5, commands
    for name, argv in commands:
        if "--" in argv:  # `launch ... -- python train.py`: the rest is the user's
            argv = argv[:argv.index("--")]
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit:
            assert not exit.code, f"`keras-vmoe {name} --help` prints a refused command: {argv}"
        assert not _unknown_presets(argv), (
            f"`keras-vmoe {name} --help` names unknown presets: {_unknown_presets(argv)}")


@pytest.mark.parametrize("page", PAGES, ids=_page_name)
def test_page_commands_parse(page, tmp_path, monkeypatch):
    """Every `keras-vmoe` command of a page (```bash blocks and inline
    commands with options) is accepted as printed. Run in an empty folder,
    where the image folders that `--data` names are made."""
    from keras_vmoe.cli import build_parser
    from keras_vmoe.cli.convert_cmd import build_parser as convert_parser

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    text = page.read_text(encoding="utf-8")
    for argv in bash_commands(text) + inline_commands(text):
        for flag, value in zip(argv, argv[1:], strict=False):
            if flag == "--data" and value != "digits" and not value.startswith("tfds:"):
                _image_folder(tmp_path / value)
        try:
            if argv[:1] == ["convert"]:
                convert_parser().parse_args(argv[1:])
            else:
                parser.parse_args(argv)
        except SystemExit as exit:
            if exit.code:
                pytest.fail(f"{_page_name(page)}: `keras-vmoe {' '.join(argv)}` is "
                            f"refused by the command line (exit {exit.code})")
        unknown = _unknown_presets(argv)
        assert not unknown, (f"{_page_name(page)}: `keras-vmoe {' '.join(argv)}` "
                             f"names unknown presets {unknown}")


@pytest.mark.xdist_group("docstrings")
@pytest.mark.parametrize("where,code,reason", DOCSTRING_BLOCKS,
                         ids=[b[0] for b in DOCSTRING_BLOCKS])
def test_docstring_block_runs(docstring_results, where, code, reason):
    _check(docstring_results, where, code, reason)


@pytest.mark.parametrize("module", doctest_modules())
def test_docstring_doctests(module):
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(mod, module, globs=dict(vars(mod)))
    assert tests, f"{module} has '>>>' but doctest found no examples"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} doctest example(s) of {module} fail"


def test_readme_is_a_front_page_whose_links_resolve():
    text = README.read_text(encoding="utf-8")
    # The set-up commands open the page; the guides live in docs/.
    assert text.splitlines()[8:10] == [
        'pip install . && keras-vmoe                          # main job: fine-tune a '
        'V-MoE on the embedded digits (offline)',
        'pip install ".[tests]" && KERAS_BACKEND=jax pytest   # the fast test suite on '
        '2 xdist workers (times below)']
    assert len(text.splitlines()) <= 260
    targets = re.findall(r"\]\(([^)#\s]+)\)", text)
    assert "docs/api/index.md" in targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_preset_catalog_page_follows_the_catalog(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_catalog", DOCS / "make_catalog.py")
    make_catalog = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_catalog)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # render() sets KERAS_HOME
    assert make_catalog.main(["--check"]) == 0, (
        "docs/catalog.md is stale: run `python docs/make_catalog.py`")
    assert make_catalog.render().count("\n| `") == len(
        __import__("keras_vmoe.catalog", fromlist=["PRESETS"]).PRESETS)


def test_gitignore_lists_what_the_documented_commands_write():
    ignored = (ROOT / ".gitignore").read_text().split()
    # keras-vmoe's default output, the README's converted example, mkdocs'.
    for folder in ("keras_vmoe_finetune/", "vmoe_tiny_preset/", "site/"):
        assert folder in ignored, f".gitignore lacks {folder}"


def test_install_commands_and_extras_tables_agree_with_pyproject():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for page in PAGES:
        if page.name == "development.md":  # a development install is editable
            continue
        text = page.read_text()
        assert "pip install -e" not in text, f"{page.name}: `pip install -e` for users"
        rows = dict(re.findall(r"^\| `\[(\w+)\]` \| ([^|]+) \|", text, flags=re.M))
        if "docs" in rows:  # every package of the extra that builds the site
            for requirement in extras["docs"]:
                package = re.split(r"[<>=]", requirement)[0]
                assert package in rows["docs"], f"{page.name}: the [docs] row lacks {package}"
        if "notebooks" in rows:
            assert "pydot" in rows["notebooks"], f"{page.name}: [notebooks] lacks pydot"
    assert any(r.startswith("pydot") for r in extras["notebooks"]), \
        "no extra provides pydot (keras.utils.plot_model)"


def test_no_paragraph_is_glued_to_the_one_before():
    for page in PAGES:
        inside_code = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside_code = not inside_code
            assert inside_code or not re.match(r"^ [A-Za-z`]", line), (
                f"{page.name}:{number}: a line starting with one space: {line!r}")
