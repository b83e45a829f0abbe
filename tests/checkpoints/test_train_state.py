"""Checkpoints of the upstream trainer (whole train states) convert.

The upstream trainer saves its `TrainState` (`step`, `params`, `opt_state`,
`rngs`) with an Orbax `CheckpointManager` at `workdir/ckpt` (items `state`,
a PyTree, and `dataset_iterator`, JSON); before 2023-08 it wrote partitioned
`workdir/ckpt_<step>` checkpoints of the same tree. These tests write such
checkpoints around the parameters of the fixtures in tests/data/upstream_vmoe
(with the real Orbax API and `keras_vmoe.formats.save_checkpoint`),
convert them and compare with the fixtures' upstream logits, with the
tolerances of test_conversion_parity.py.
"""

import json
import sys

import numpy as np
import pytest

from keras_vmoe.cli import convert_cmd
from keras_vmoe.conversion import build_model_from_upstream
from keras_vmoe.conversion import validate
from keras_vmoe.formats import CheckpointError
from keras_vmoe.formats import load_upstream_params
from keras_vmoe.formats import partitioned as P
from keras_vmoe.formats import save_checkpoint
from keras_vmoe.formats import train_state
from keras_vmoe.formats.upstream import resolve_upstream

ocp = pytest.importorskip("orbax.checkpoint")

# One variant per fixture: {fixture: (variant, routing, atol)}. The routing is
# `routing_of_variant` (test_conversion_parity.py) of the variant's upstream
# config; the tolerances are those of the parity tests (f32 dispatch 1e-4;
# Soft MoE always dispatches in bf16: 1e-3).
CASES = {
    "vmoe_tiny": ("f32dispatch", dict(
        router="token_choice", num_selected_experts=2, capacity_factor=1.0,
        group_size=34, bfloat16_dispatch=False, batch_priority=False), 1e-4),
    "vmoe_tiny_ec": ("f32dispatch", dict(
        router="expert_choice", capacity_factor=1.0, group_size=34,
        bfloat16_dispatch=False), 1e-4),
    "eee_tiny": ("f32dispatch", dict(
        router="token_choice", num_selected_experts=1, capacity_factor=1.5,
        group_size=68, bfloat16_dispatch=False, batch_priority=False), 1e-4),
    "softmoe_tiny": ("main", {}, 1e-3),
}
STEPS = (100, 300)  # Step 100 holds perturbed parameters, 300 the fixture's.


def _nested(flat):
    tree = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return tree


def _map(fn, tree):
    return {k: _map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _train_state(params, step, subtree="params"):
    """A TrainState-shaped tree: optax chain state (Adam slots + an empty
    state), the step and the PRNG keys of the model's rngs."""
    import jax

    return {
        "step": np.asarray(step, np.int32),
        subtree: params,
        "opt_state": (
            {"count": np.asarray(step, np.int32),
             "mu": _map(lambda x: np.full_like(x, 0.5), params),
             "nu": _map(lambda x: np.full_like(x, 0.25), params)},
            {},
        ),
        "rngs": {"dropout": np.asarray(jax.random.key_data(jax.random.key(1))),
                 "gating": np.asarray(jax.random.key_data(jax.random.key(2)))},
    }


def _fixture(upstream_dir, fixture):
    flat = load_upstream_params(str(upstream_dir / fixture / "checkpoint"))
    return flat, _nested(flat)


def _routing(upstream_dir, fixture):
    """Routing, reference logits file and tolerance of a fixture's variant."""
    variant, routing, atol = CASES[fixture]
    suffix = "" if variant == "main" else f"_{variant}"
    return routing, upstream_dir / fixture / f"logits{suffix}.npy", atol


def _on_devices(state):
    """jax.Arrays as the trainer saves them: expert weights (leading axis E)
    sharded over an 'expert' mesh axis, everything else replicated."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec

    devices = np.asarray(jax.devices()[:2])
    mesh = Mesh(devices, ("expert",))

    def put(path, x):
        spec = (PartitionSpec("expert") if "/Moe/Mlp/" in path
                and x.shape[0] % len(devices) == 0 else PartitionSpec())
        return jax.device_put(x, NamedSharding(mesh, spec))

    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, tuple):
            return tuple(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return put(path, node)

    return walk(state, "")


def write_orbax(root, states, use_ocdbt=True):
    """Writes `{step: state}` the way the upstream trainer does."""
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt),
        "dataset_iterator": ocp.JsonCheckpointHandler(),
    }
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(str(root), options=options,
                               item_handlers=handlers) as manager:
        for step, state in sorted(states.items()):
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                dataset_iterator=ocp.args.JsonSave({"step": step, "position": 7}),
            ))
        manager.wait_until_finished()
    return root


@pytest.fixture(scope="module")
def orbax_runs(upstream_dir, tmp_path_factory):
    """`orbax_runs(fixture)` -> a workdir whose `ckpt/` holds steps 100
    (perturbed parameters) and 300 (the fixture's), written on first use."""
    runs = {}

    def get(fixture):
        if fixture not in runs:
            _, params = _fixture(upstream_dir, fixture)
            workdir = tmp_path_factory.mktemp(fixture)
            states = {
                STEPS[0]: _train_state(_map(lambda x: x + 1.0, params), STEPS[0]),
                STEPS[1]: _train_state(params, STEPS[1]),
            }
            states = {step: _on_devices(state) for step, state in states.items()}
            write_orbax(workdir / "ckpt", states)
            runs[fixture] = workdir
        return runs[fixture]

    return get


def _assert_same_params(actual, expected):
    assert sorted(actual) == sorted(expected)
    for path, value in expected.items():
        assert actual[path].dtype == value.dtype, path
        np.testing.assert_array_equal(actual[path], value, err_msg=path)


# ---------------------------------------------------------------------------
# Orbax.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", [
    "vmoe_tiny",
    pytest.param("vmoe_tiny_ec", marks=pytest.mark.slow),
    pytest.param("eee_tiny", marks=pytest.mark.slow),
    # Soft MoE: also checked (through the command line) in the default suite.
    pytest.param("softmoe_tiny", marks=pytest.mark.slow),
])
def test_orbax_train_state_reproduces_fixture_logits(orbax_runs, upstream_dir, fixture):
    flat, _ = _fixture(upstream_dir, fixture)
    ckpt = orbax_runs(fixture) / "ckpt"
    resolved = resolve_upstream(str(ckpt))
    assert (resolved.format, resolved.step, resolved.subtree) == ("orbax", 300, "params")
    assert resolved.available_steps == STEPS
    assert resolved.location == str(ckpt / "300" / "state")
    # Optimizer slots, count, step and rngs are left out: 2 slots per param + 4.
    assert resolved.skipped_leaves == 2 * len(flat) + 4
    assert dict(resolved.shapes) == {k: v.shape for k, v in flat.items()}

    routing, logits, atol = _routing(upstream_dir, fixture)
    model = build_model_from_upstream(str(ckpt), **routing)
    inputs = np.load(upstream_dir / fixture / "inputs.npy")
    assert validate(model, inputs, np.load(logits), atol=atol) <= atol


def test_orbax_step_item_and_workdir_spellings(orbax_runs, upstream_dir):
    flat, _ = _fixture(upstream_dir, "vmoe_tiny")
    workdir = orbax_runs("vmoe_tiny")
    ckpt = workdir / "ckpt"
    for path, step, expected_step in [
        (workdir, None, 300), (ckpt, None, 300), (ckpt, 100, 100),
        (ckpt / "100", None, 100), (ckpt / "300" / "state", None, 300),
        (ckpt / "300", 100, 100),  # a step directory plus --step: its sibling
    ]:
        resolved = resolve_upstream(str(path), step)
        assert resolved.step == expected_step, (path, step)
        assert resolved.location == str(ckpt / str(expected_step) / "state")
    # --step 100 reads that step's (perturbed) parameters.
    _assert_same_params(load_upstream_params(str(ckpt), step=100),
                        {k: v + 1.0 for k, v in flat.items()})
    _assert_same_params(load_upstream_params(str(workdir)), flat)


def test_orbax_reads_only_the_params_subtree(upstream_dir, tmp_path):
    """With the per-array (non-OCDBT) layout every array has its own
    directory: deleting the data of the optimizer state, step and rngs
    (keeping their `.zarray` shape metadata) proves they are never read."""
    flat, params = _fixture(upstream_dir, "vmoe_tiny")
    ckpt = write_orbax(tmp_path / "ckpt", {5: _train_state(params, 5)},
                       use_ocdbt=False)
    item = ckpt / "5" / "state"
    others = [p for p in item.iterdir()
              if p.is_dir() and not p.name.startswith("params.")]
    assert len(others) == 2 * len(flat) + 4
    removed = [f for d in others for f in d.iterdir() if f.name != ".zarray"]
    assert len(removed) >= len(others)
    for path in removed:
        path.unlink()
    _assert_same_params(load_upstream_params(str(ckpt)), flat)
    # The same checkpoint without the data of one parameter fails clearly.
    next(f for f in (item / "params.head.kernel").iterdir() if f.name != ".zarray").unlink()
    # (found from the chunk files before anything is restored)
    with pytest.raises(CheckpointError, match="head/kernel.*holds 0 chunk file"):
        load_upstream_params(str(ckpt))


@pytest.mark.heavy
def test_command_line_converts_orbax_and_reports_the_step(orbax_runs, upstream_dir,
                                                          tmp_path, capsys):
    from keras_vmoe import cli

    fixture_dir = upstream_dir / "softmoe_tiny"
    out = tmp_path / "soft"
    status = cli.main([
        "convert", "--upstream", str(orbax_runs("softmoe_tiny") / "ckpt"),
        "--output", str(out),
        "--validate-inputs", str(fixture_dir / "inputs.npy"),
        "--validate-logits", str(fixture_dir / "logits.npy"), "--atol", "1e-3",
    ])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "step 300" in captured.err and "'params' subtree" in captured.err
    assert "(step 300)" in captured.out
    conversion = json.loads((out / "metadata.json").read_text())["conversion"]
    assert conversion["checkpoint"] == {
        "format": "orbax", "location": str(orbax_runs("softmoe_tiny") / "ckpt" / "300"
                                           / "state"),
        "step": 300, "params_subtree": "params",
    }
    assert conversion["validation_max_abs_diff"] <= 1e-3

    # A step that does not exist: listed alternatives, exit 1, nothing written.
    out2 = tmp_path / "soft2"
    assert cli.main(["convert", "--upstream", str(orbax_runs("softmoe_tiny") / "ckpt"),
                     "--output", str(out2), "--step", "7"]) == 1
    err = capsys.readouterr().err
    assert "no step 7" in err and "Available steps: [100, 300]" in err
    assert not out2.exists()
    with pytest.raises(SystemExit):
        cli.main(["convert", "--upstream", "x", "--output", "y", "--step", "-3"])


def test_orbax_errors(upstream_dir, tmp_path):
    _, params = _fixture(upstream_dir, "softmoe_tiny")
    not_ckpt = tmp_path / "notes"
    not_ckpt.mkdir()
    (not_ckpt / "README.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"is not a checkpoint directory.*README"):
        resolve_upstream(str(not_ckpt))
    with pytest.raises(CheckpointError, match=r"Did you mean --upstream .*vmoe_tiny/checkpoint\?"):
        resolve_upstream(str(upstream_dir / "vmoe_tiny"))
    with pytest.raises(CheckpointError, match=r"No checkpoint at .*nowhere.*index"):
        resolve_upstream(str(tmp_path / "nowhere" / "ckpt"))
    # A state without parameters.
    state = _train_state(params, 3)
    del state["params"]
    ckpt = write_orbax(tmp_path / "ckpt", {3: state})
    with pytest.raises(CheckpointError, match=r"holds no model parameters.*'opt_state'"):
        resolve_upstream(str(ckpt))
    # An item plus another step.
    with pytest.raises(CheckpointError, match="of step 3; pass its CheckpointManager"):
        resolve_upstream(str(ckpt / "3" / "state"), step=4)
    with pytest.raises(ValueError,
                       match=r"`step` must be None or an integer >= 0\. Received: step=-1"):
        resolve_upstream(str(ckpt), step=-1)


def test_without_orbax_the_error_says_what_to_install(orbax_runs, upstream_dir,
                                                      tmp_path, monkeypatch, capsys):
    # Importing orbax.checkpoint fails as if it were not installed.
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    ckpt = orbax_runs("softmoe_tiny") / "ckpt"
    with pytest.raises(train_state.OrbaxNotInstalledError) as info:
        resolve_upstream(str(ckpt))
    assert isinstance(info.value, ImportError)
    assert 'pip install "keras-vmoe[orbax]"' in str(info.value)
    out = tmp_path / "out"
    assert convert_cmd.run(["--upstream", str(ckpt), "--output", str(out)]) == 1
    assert 'pip install "keras-vmoe[orbax]"' in capsys.readouterr().err
    assert not out.exists()
    # Step errors need no Orbax; partitioned checkpoints neither.
    with pytest.raises(CheckpointError, match=r"Available steps: \[100, 300\]"):
        resolve_upstream(str(ckpt), step=200)
    flat = load_upstream_params(str(upstream_dir / "softmoe_tiny" / "checkpoint"))
    assert any(k.endswith("/Moe/Router/mu") for k in flat)


# ---------------------------------------------------------------------------
# Partitioned train states (the trainer before Orbax: workdir/ckpt_<step>).
# ---------------------------------------------------------------------------


def _write_partitioned_state(prefix, state):
    """Params in shard 0; optimizer state, step and rngs in shard 1."""
    flat = {}

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}" if path else key)
        elif isinstance(node, tuple):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")
        else:
            flat[path] = node

    walk(state, "")
    tree = _nested(flat)
    shards = {p: [0 if p.split("/")[0] not in train_state.TRAIN_STATE_KEYS else 1]
              for p in flat}
    save_checkpoint(str(prefix), tree, num_shards=2, chunk_shards=shards)


def test_partitioned_train_state_reproduces_fixture_logits(upstream_dir, tmp_path):
    flat, params = _fixture(upstream_dir, "vmoe_tiny")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    _write_partitioned_state(workdir / "ckpt_100",
                             _train_state(_map(lambda x: x * 2.0, params), 100))
    _write_partitioned_state(workdir / "ckpt_200", _train_state(params, 200))
    # The optimizer state is in the second shard: without it, conversion works.
    (workdir / "ckpt_200.data-00001-of-00002").unlink()
    resolved = resolve_upstream(str(workdir / "ckpt"))
    assert (resolved.format, resolved.step, resolved.subtree) == (
        "partitioned", 200, "params")
    assert resolved.available_steps == (100, 200)
    assert "step 200" in resolved.describe()
    for spelling in (workdir, workdir / "ckpt_200", str(workdir / "ckpt_200") + ".index"):
        assert resolve_upstream(str(spelling)).location == str(
            workdir / "ckpt_200")
    routing, logits, atol = _routing(upstream_dir, "vmoe_tiny")
    model = build_model_from_upstream(str(workdir / "ckpt"), **routing)
    inputs = np.load(upstream_dir / "vmoe_tiny" / "inputs.npy")
    assert validate(model, inputs, np.load(logits), atol=atol) <= atol
    # --step picks the other one, from the prefix or from another step's name.
    for path in (workdir / "ckpt", workdir / "ckpt_200"):
        _assert_same_params(load_upstream_params(str(path), step=100),
                            {k: v * 2.0 for k, v in flat.items()})
    with pytest.raises(CheckpointError, match=r"no step 150.*\[100, 200\]"):
        resolve_upstream(str(workdir / "ckpt"), step=150)
    # Released (params-only) checkpoints have no steps.
    with pytest.raises(CheckpointError, match="no step 1.*not a trainer checkpoint"):
        resolve_upstream(str(upstream_dir / "vmoe_tiny" / "checkpoint"), step=1)


def test_partitioned_state_fallbacks_and_errors(upstream_dir, tmp_path):
    flat, params = _fixture(upstream_dir, "softmoe_tiny")
    # A state that keeps only an EMA of the parameters; its step is read from
    # the `step` leaf when the name has none.
    _write_partitioned_state(tmp_path / "ema", _train_state(params, 42, "ema_params"))
    resolved = resolve_upstream(str(tmp_path / "ema"))
    assert (resolved.subtree, resolved.step) == ("ema_params", 42)
    assert "'ema_params' subtree" in resolved.describe()
    _assert_same_params(dict(resolved.iter_params()), flat)
    # A state without parameters.
    state = _train_state(params, 1)
    del state["params"]
    _write_partitioned_state(tmp_path / "noparams", state)
    with pytest.raises(CheckpointError, match="holds no model parameters"):
        resolve_upstream(str(tmp_path / "noparams"))
    # The same selection for a flat train state in memory.
    in_memory = {f"ema_params/{k}": v for k, v in flat.items()}
    in_memory.update({"step": np.asarray(3), "opt_state/0/count": np.asarray(3)})
    assert resolve_upstream(in_memory).keys() == flat.keys()
    with pytest.raises(CheckpointError, match="holds no model parameters"):
        resolve_upstream({"step": np.asarray(3)})
    # A .npz has no steps.
    with pytest.raises(ValueError, match="has no steps"):
        resolve_upstream(str(tmp_path / "vit.npz"), step=3)


BOMB_SHAPE = (48, 10**8)  # 19.2 GB of float32


@pytest.fixture(scope="module")
def params(upstream_dir):
    return load_upstream_params(upstream_dir / "vmoe_tiny" / "checkpoint")


def test_orbax_zarray_declaring_a_huge_array_is_refused(params, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {}
    for key, value in params.items():
        node = tree
        *parents, last = key.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = np.asarray(value)
    item = tmp_path / "state"
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    checkpointer.save(str(item), args=ocp.args.PyTreeSave({"params": tree}))
    checkpointer.close()
    zarray = item / "params.head.kernel" / ".zarray"
    header = json.loads(zarray.read_text())
    header["shape"] = list(BOMB_SHAPE)
    zarray.write_text(json.dumps(header))
    with pytest.raises(P.CheckpointError) as info:
        train_state.resolve_checkpoint(str(item))
    message = str(info.value)
    assert str(zarray) in message and str(BOMB_SHAPE) in message
    assert "chunk file" in message
