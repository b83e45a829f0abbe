"""Behaviour of the MoE layers: dispatch paths, Soft MoE, E³, errors, I/O."""

import jax
import keras
import numpy as np
import pytest
import testing
from keras import ops
from tiny_configs import tiny_moe_layer as _moe_layer

from keras_vmoe import layers
from keras_vmoe.layers import ExpertChoiceRouter
from keras_vmoe.layers import Experts
from keras_vmoe.layers import MoeLayer
from keras_vmoe.layers import PartitionedMoE
from keras_vmoe.layers import SoftMoE
from keras_vmoe.layers import TokenChoiceRouter
from keras_vmoe.layers import tile_for_ensemble
from keras_vmoe.layers.allocation import token_choice_allocation
from keras_vmoe.utils import memory_budget

SPARSE_ROUTERS = [
    {"name": "token_choice", "num_selected_experts": 2, "capacity_factor": 0.6},
    {"name": "token_choice", "num_selected_experts": 2, "batch_priority": True,
     "capacity_factor": 0.6},
    {"name": "sinkhorn_token_choice", "num_selected_experts": 1},
    {"name": "expert_choice", "capacity_factor": 1.0},
    {"name": "sinkhorn_expert_choice", "capacity_factor": 1.0},
    {"name": "sparse_expert_choice", "capacity_factor": 1.0},
]


def _inputs(shape=(2, 12, 16), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _pair(router, **kwargs):
    """An index-dispatch layer and an einsum-reference layer with equal weights."""
    index = MoeLayer(4, 32, router=dict(router), dispatch="index", identical_init=False,
                     **kwargs)
    einsum = MoeLayer(4, 32, router=dict(router), dispatch="einsum", **kwargs)
    x = _inputs()
    index(x)
    einsum(x)
    einsum.set_weights(index.get_weights())
    return index, einsum, x


@pytest.mark.parametrize("router", SPARSE_ROUTERS, ids=lambda r: r["name"])
def test_index_dispatch_equals_einsum_reference(router):
    index, einsum, x = _pair(router, group_size=12)
    np.testing.assert_allclose(index(x), einsum(x), atol=1e-5)

    def loss_fn(layer):
        def f(trainable, x):
            frozen = [v.value for v in layer.non_trainable_variables]
            y, _ = layer.stateless_call(trainable, frozen, x)
            return ops.sum(ops.square(y))
        return f

    tv = [v.value for v in index.trainable_variables]
    g_index = jax.grad(loss_fn(index), argnums=(0, 1))(tv, x)
    g_einsum = jax.grad(loss_fn(einsum), argnums=(0, 1))(tv, x)
    for a, b in zip(jax.tree.leaves(g_index), jax.tree.leaves(g_einsum), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.heavy
def test_bfloat16_dispatch_rounds_expert_inputs_and_outputs():
    index, _, x = _pair(SPARSE_ROUTERS[0])
    rounded = MoeLayer(4, 32, router=dict(SPARSE_ROUTERS[0]), bfloat16_dispatch=True)
    rounded(x)
    rounded.set_weights(index.get_weights())
    diff = np.abs(np.asarray(rounded(x)) - np.asarray(index(x))).max()
    assert 0 < diff < 5e-2


def test_expert_choice_is_balanced():
    router = ExpertChoiceRouter(4, capacity_factor=1.0, capacity_multiple_of=1)
    routing = router(ops.convert_to_tensor(_inputs((3, 20, 8))))
    buffer_token = np.asarray(routing.buffer_token)
    assert buffer_token.shape == (3, 4, 5)
    assert (buffer_token < 20).all()  # every slot of every expert is used
    for g in range(3):
        for e in range(4):
            assert len(set(buffer_token[g, e])) == 5


def test_bpr_drops_only_lowest_priority_tokens():
    rng = np.random.default_rng(3)
    gates = ops.softmax(rng.normal(size=(1, 64, 4)).astype("float32") * 3, axis=-1)
    alloc = token_choice_allocation(gates, gates, 1, 6, batch_priority=True)
    top = np.asarray(gates)[0].max(-1)
    expert = np.asarray(alloc["token_expert"])[0, :, 0]
    kept = np.asarray(alloc["token_slot"])[0, :, 0] < 6
    assert (~kept).any()
    for e in range(4):
        chose = expert == e
        if (chose & ~kept).any():
            assert top[chose & kept].min() >= top[chose & ~kept].max()
    vanilla = token_choice_allocation(gates, gates, 1, 6, batch_priority=False)
    vanilla_kept = np.asarray(vanilla["token_slot"])[0, :, 0] < 6
    # Vanilla keeps the first tokens in order instead.
    assert not np.array_equal(kept, vanilla_kept)


@pytest.mark.heavy
def test_soft_moe_is_per_example_and_drops_nothing():
    # f32 dispatch: bf16 rounding could amplify float noise between batch shapes.
    layer = SoftMoE(8, 32, num_slots=2, identical_init=False, bfloat16_dispatch=False)
    x = _inputs((3, 10, 16))
    full = np.asarray(layer(x))
    alone = np.asarray(layer(x[1:2]))
    np.testing.assert_allclose(full[1:2], alone, atol=1e-5)
    routing = layer.router(ops.convert_to_tensor(x))
    np.testing.assert_allclose(np.asarray(routing.combine_weights).sum((2, 3)), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(routing.dispatch_weights).sum(1), 1.0, atol=1e-5)


def test_soft_moe_slots_from_capacity_factor():
    layer = SoftMoE(4, 32, capacity_factor=1.0)
    layer(_inputs((1, 10, 16)))
    assert layer.router.mu.shape == (16, 4, 2)  # round(10/4) = 2 (half to even)


@pytest.mark.heavy
def test_partitioned_moe_members_use_their_own_experts():
    layer = PartitionedMoE(4, 32, num_partitions=2,
                           router={"capacity_factor": 4.0, "num_selected_experts": 1})
    x = tile_for_ensemble(ops.convert_to_tensor(_inputs((2, 6, 16))), 2)
    grouped = layer.group_tokens(x)
    layer(x)
    routing = layer.router(grouped)
    expert = np.asarray(routing.token_expert)[..., 0]  # (G, S)
    member = np.arange(expert.shape[1]) % 2
    assert ((expert // 2) == member[None]).all()
    # Tokens are regrouped (B·N, T, D) -> (B, T, N, D) and restored exactly.
    np.testing.assert_allclose(layer.ungroup_tokens(grouped, ops.shape(x)), x)
    assert routing.auxiliary_losses["importance_loss"].shape == (1, 2)


@pytest.mark.heavy
def test_batch_of_one_image_and_group_size():
    layer = MoeLayer(4, 32, router={"name": "token_choice", "num_selected_experts": 2})
    assert layer(_inputs((1, 7, 16))).shape == (1, 7, 16)
    layer.group_size = 7
    assert layer(_inputs((3, 7, 16))).shape == (3, 7, 16)
    # 6 tokens do not fill a group of 7: the group is padded.
    assert layer(_inputs((1, 6, 16))).shape == (1, 6, 16)


@pytest.mark.heavy
def test_settings_change_on_built_layer():
    layer = MoeLayer(4, 32, router={"name": "token_choice", "num_selected_experts": 2,
                                    "capacity_factor": 1.0})
    x = _inputs((2, 12, 16))
    y1 = np.asarray(layer(x))
    layer.capacity_factor = 0.1
    layer.batch_priority = True
    layer.num_selected_experts = 1
    assert layer.router.get_capacity(24) == 4
    assert not np.allclose(y1, np.asarray(layer(x)))


def test_training_adds_auxiliary_loss_and_metrics():
    layer = MoeLayer(4, 32, router={"name": "token_choice", "num_selected_experts": 2})
    x = _inputs((2, 12, 16))
    y, metrics = layer(x, training=True, return_metrics=True)
    assert len(layer.losses) == 1
    assert float(layer.losses[0]) > 0
    for key in ("importance_loss", "load_loss", "gshard_loss", "auxiliary_loss",
                "tokens_dropped_fraction", "expert_fill", "capacity"):
        assert key in metrics
    layer(x, training=False)
    assert len(layer.losses) == 0


@pytest.mark.heavy
def test_fit_with_moe_layer():
    inputs = keras.Input((12, 16))
    h = MoeLayer(4, 32, router={"name": "token_choice", "num_selected_experts": 2},
                 name="moe")(inputs)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(_inputs((8, 12, 16)), np.arange(8) % 3, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize(
    "factory",
    [
        lambda: MoeLayer(4, 32, router={"name": "token_choice", "num_selected_experts": 2,
                                        "batch_priority": True}, group_size=12,
                         bfloat16_dispatch=True, name="moe"),
        lambda: MoeLayer(4, 32, router={"name": "sparse_expert_choice"}, name="moe"),
        lambda: SoftMoE(4, 32, num_slots=2, name="moe"),
        lambda: PartitionedMoE(4, 32, num_partitions=2, router={"capacity_factor": 2.0},
                               name="moe"),
    ],
    ids=["token_choice", "sparse_ec", "soft", "partitioned"],
)
@pytest.mark.heavy
def test_serialization_round_trip(factory, tmp_path):
    layer = factory()
    x = _inputs((2, 12, 16))
    inputs = keras.Input((12, 16))
    model = keras.Model(inputs, layer(inputs))
    expected = np.asarray(model(x))
    restored_layer = type(layer).from_config(layer.get_config())
    assert restored_layer.get_config() == layer.get_config()
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(np.asarray(restored(x)), expected, atol=1e-6)
    assert [w.path for w in restored.weights] == [w.path for w in model.weights]


def test_experts_identical_and_independent_init():
    same = Experts(4, 8)
    same.build((None, 4, None, 6))
    k = np.asarray(same.kernel_0)
    assert np.allclose(k, k[:1])
    # Per-expert fans: glorot limit sqrt(6 / (6 + 8)).
    assert np.abs(k).max() <= np.sqrt(6 / 14) + 1e-6
    diff = Experts(4, 8, identical_init=False)
    diff.build((None, 4, None, 6))
    k = np.asarray(diff.kernel_0)
    assert not np.allclose(k[0], k[1])


@pytest.mark.parametrize("make", [
    lambda: MoeLayer(4, 32, router={"num_selected_experts": 2}, identical_init=False),
    lambda: SoftMoE(4, 32, num_slots=2, identical_init=False, bfloat16_dispatch=False),
], ids=["moe", "soft_moe"])
@pytest.mark.heavy
def test_expert_loop_equals_batched_matmuls(make):
    layer = make()
    x = _inputs()
    layer(x)
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def value_and_grads(implementation):
        layer.experts.implementation = implementation

        def f(trainable, x):
            y, _ = layer.stateless_call(trainable, ntv, x)
            return ops.sum(ops.square(y)), y
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(tv, x)

    (loss_l, y_l), g_l = value_and_grads("loop")
    (loss_b, y_b), g_b = value_and_grads("batched")
    np.testing.assert_allclose(y_l, y_b, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_l), jax.tree.leaves(g_b), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_expert_implementation_choice_and_config():
    experts = Experts(4, 8, implementation="auto")
    assert not experts.uses_loop(training=False)  # rows unknown: batched
    assert not experts.uses_loop(training=False, rows=4096)  # 0.5 MiB hidden
    big = Experts(8, 3072, implementation="auto")  # V-MoE-B/16 experts
    assert big.uses_loop(training=False, rows=416)  # 39 MiB hidden: loop
    assert not big.uses_loop(training=False, rows=200)  # 19 MiB: batched
    assert not big.uses_loop(training=True, rows=416)  # training runs batched
    s32 = Experts(32, 2048, implementation="auto")  # V-MoE S/32 E=32 experts
    assert not s32.uses_loop(training=False, rows=108)  # 27 MiB, few rows
    assert s32.uses_loop(training=False, rows=128)  # 32 MiB
    many = Experts(128, 1536, implementation="auto")  # Soft MoE S/16 experts
    assert not many.uses_loop(training=False, rows=32)  # few rows: batched
    dropout = Experts(4, 8, dropout_rate=0.1, implementation="loop")
    assert dropout.uses_loop(training=False)
    assert not dropout.uses_loop(training=True)  # one mask for all experts
    restored = Experts.from_config(Experts(4, 8, implementation="batched").get_config())
    assert restored.implementation == "batched"


def test_auto_experts_never_loop_on_accelerators(monkeypatch):
    from keras_vmoe.layers import experts as experts_lib

    big = Experts(8, 3072, implementation="auto")  # V-MoE-B/16 experts
    assert experts_lib.compute_platform() == "cpu"  # the test machines
    assert big.uses_loop(training=False, rows=416)
    monkeypatch.setattr(experts_lib, "compute_platform", lambda: "gpu")
    assert not big.uses_loop(training=False, rows=416)  # batched on a GPU
    assert Experts(8, 3072, implementation="loop").uses_loop(training=False, rows=416)
    with pytest.raises(ValueError, match=r"`implementation` must be one of.*'fast'"):
        Experts(4, 8, implementation="fast")


def test_clear_errors():
    with pytest.raises(ValueError, match="num_selected_experts"):
        TokenChoiceRouter(4, num_selected_experts=5)
    with pytest.raises(ValueError, match="divisible by"):
        PartitionedMoE(6, 32, num_partitions=4)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        MoeLayer(64, 8, router={"name": "expert_choice", "capacity_factor": 0.01,
                                "capacity_ceil_or_round": "round",
                                "capacity_multiple_of": 1})(_inputs((1, 4, 16)))
    with pytest.raises(ValueError, match="rank 3"):
        MoeLayer(4, 8)(_inputs((4, 16)))
    with pytest.raises(ValueError, match="Unknown router"):
        MoeLayer(4, 8, router="top_any")
    with pytest.raises(ValueError, match="dispatch"):
        MoeLayer(4, 8, dispatch="dense")
    with pytest.raises(ValueError, match=r"`mlp_dim` must be an integer >= 1.*0"):
        MoeLayer(4, 0)
    with pytest.raises(ValueError, match=r"`num_experts` must be an integer >= 1"):
        SoftMoE(2.5, 8)


def _flops(layer, x):
    layer(x)
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def f(tv, x):
        return layer.stateless_call(tv, ntv, x)[0]

    analysis = jax.jit(f).lower(tv, x).compile().cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0]
    return analysis["flops"]


@pytest.mark.slow  # compiles a dozen layers for XLA's cost analysis
def test_flops_grow_with_k_and_capacity_not_experts():
    x = _inputs((1, 256, 64))

    def flops(num_experts, k, cf=1.0, dispatch="index"):
        router = {"name": "token_choice", "num_selected_experts": k, "capacity_factor": cf}
        return _flops(MoeLayer(num_experts, 256, router=router, dispatch=dispatch), x)

    base = flops(4, 1)
    assert flops(32, 1) < 1.3 * base  # more experts, same activated compute
    assert 1.7 * base < flops(4, 2) < 2.3 * base
    assert 1.7 * base < flops(4, 1, cf=2.0) < 2.3 * base
    # The one-hot reference does hidden O(S·E·C·D) work that the index path avoids.
    assert flops(32, 1, dispatch="einsum") > 1.5 * flops(32, 1)


def test_expert_weights_have_independent_random_values():
    experts = Experts(2, 6)
    experts.build((None, 2, None, 6))
    k0 = np.asarray(experts.kernel_0).ravel()
    k1 = np.asarray(experts.kernel_1).ravel()
    assert not np.allclose(k0, k1)


@pytest.mark.heavy
def test_auto_implementation_loops_only_over_large_hidden_activations(monkeypatch):
    from keras_vmoe.layers import experts as experts_lib

    layer = Experts(4, 8, implementation="auto")
    x = keras.random.normal((2, 4, 16, 12))  # (G, E, C, D): 32 rows per expert
    layer(x)
    tv = [v.value for v in layer.trainable_variables]

    def traced(training):
        fn = lambda w, x: layer.stateless_call(w, [], x, training=training)[0]  # noqa: E731
        return str(jax.make_jaxpr(fn)(tv, x))

    assert "scan" not in traced(False)  # 4 KiB of hidden activations
    monkeypatch.setattr(experts_lib, "LOOP_MIN_ROWS", 32)  # default: 128
    monkeypatch.setattr(experts_lib, "LOOP_MIN_HIDDEN_BYTES", 4 * 32 * 8 * 4)
    assert "scan" in traced(False)
    assert "scan" not in traced(True)
    monkeypatch.setattr(experts_lib, "LOOP_MIN_ROWS", 33)
    assert "scan" not in traced(False)


def test_gather_dispatch_and_combine_leave_empty_and_dropped_slots_exactly_zero():
    from keras_vmoe.layers import dispatch

    x = np.arange(2 * 3 * 2, dtype="float32").reshape(2, 3, 2) + 1.0  # (G, S, D)
    buffer_token = np.array([[[2, 3], [0, 3]], [[3, 3], [1, 0]]], "int32")  # S=3: empty
    buffers = np.asarray(dispatch.gather_dispatch(x, buffer_token))  # (G, E, C, D)
    np.testing.assert_array_equal(buffers[0, 0, 0], x[0, 2])
    np.testing.assert_array_equal(buffers[0, :, 1], 0.0)
    np.testing.assert_array_equal(buffers[1, 0], 0.0)
    np.testing.assert_array_equal(buffers[1, 1, 1], x[1, 0])

    # Slot (0, 0) holds inf: a dropped choice (slot C=2) must not read it.
    y = np.ones((1, 2, 2, 2), "float32")
    y[0, 0, 0] = np.inf
    token_expert = np.array([[[1, 0], [1, 0]]], "int32")  # (G, S=2, K=2)
    token_slot = np.array([[[0, 2], [1, 2]]], "int32")
    token_weight = np.array([[[0.5, 0.0], [0.25, 0.0]]], "float32")
    out = np.asarray(dispatch.gather_combine(y, token_expert, token_slot, token_weight))
    np.testing.assert_array_equal(out, [[[0.5, 0.5], [0.25, 0.25]]])


# --- The shared test base (tests/testing.py) --------------------------------

RNG_SHARED = np.random.default_rng(0)
TOKENS = RNG_SHARED.normal(size=(2, 8, 16)).astype("float32")  # (B, T, D)


def _name(value):
    return getattr(value, "__name__", "")


MOE_LAYERS = [
    (layers.MoeLayer, dict(num_experts=4, mlp_dim=32,
                           router={"num_selected_experts": 2}), TOKENS),
    (layers.SoftMoE, dict(num_experts=4, mlp_dim=32, num_slots=2), TOKENS),
    (layers.PartitionedMoE, dict(num_experts=4, mlp_dim=32, num_partitions=2),
     layers.tile_for_ensemble(TOKENS, 2)),
]


# The MoE layers and routers compile their routing for each check: tens of
# seconds each on two cores, so they run in the heavy group.
@pytest.mark.heavy
@pytest.mark.parametrize("cls,kwargs,x", MOE_LAYERS, ids=_name)
def test_moe_layers_through_the_shared_base(cls, kwargs, x):
    testing.run_layer_test(
        cls, kwargs, x, tuple(x.shape), call_kwargs={"training": False}
    )




@pytest.mark.parametrize(
    "layer,router",
    [
        (MoeLayer, keras.layers.Dense(4)),
        (MoeLayer, ["token_choice"]),
        (PartitionedMoE, keras.layers.Dense(4)),
        (PartitionedMoE, TokenChoiceRouter(4)),  # not partitioned
    ],
    ids=["moe-dense", "moe-list", "partitioned-dense", "partitioned-token-choice"],
)
def test_a_non_router_object_is_refused_at_construction(layer, router):
    with pytest.raises(TypeError, match=r"router.*Valid names.*token_choice"):
        layer(4, 8, router=router, **({"num_partitions": 2} if layer is PartitionedMoE else {}))


def test_an_empty_batch_names_the_batch_size(classifier):
    with pytest.raises(ValueError, match="batch size 0"):
        _moe_layer()(np.zeros((0, 4, 8), "float32"))
    empty = np.zeros((0, 16, 16, 3), "float32")
    for method in (classifier.predict, classifier.backbone.predict):
        with pytest.raises(ValueError, match="batch size 0"):
            method(empty, verbose=0)
    with pytest.raises(ValueError, match="batch size 0"):
        classifier.evaluate(empty, np.zeros((0,), "int32"), verbose=0)
    # The model stays usable.
    assert classifier.predict(np.zeros((2, 16, 16, 3), "float32"), verbose=0).shape == (2, 3)


@pytest.mark.parametrize(
    "router",
    [
        keras.saving.serialize_keras_object(TokenChoiceRouter(4, name="router")),
        keras.saving.serialize_keras_object(keras.layers.Dense(4)),
    ],
    ids=["token_choice_router", "dense"],
)
def test_partitioned_moe_refuses_a_non_partitioned_router(router):
    with pytest.raises(TypeError, match="PartitionedTokenChoiceRouter"):
        PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=2, router=router)


def test_partitioned_moe_refuses_a_router_of_other_partitions():
    other = PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=4).router
    config = keras.saving.serialize_keras_object(other)
    with pytest.raises(ValueError, match="num_partitions=4.*num_partitions=2"):
        PartitionedMoE(num_experts=4, mlp_dim=8, num_partitions=2, router=config)


# The dispatch path is the same for all five; the affinity variants are slow.
NAN_IMAGE_ROUTERS = [
    "token_choice",
    "expert_choice",
    pytest.param("sinkhorn_token_choice", marks=pytest.mark.slow),
    pytest.param("sinkhorn_expert_choice", marks=pytest.mark.slow),
    pytest.param("sparse_expert_choice", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("router", NAN_IMAGE_ROUTERS)
def test_einsum_dispatch_isolates_a_nan_image(router):
    keras.utils.set_random_seed(0)
    x = np.random.RandomState(0).normal(size=(4, 6, 8)).astype("float32")
    x[1] = np.nan
    index = MoeLayer(4, 16, router={"name": router, "capacity_factor": 2.0})
    einsum = MoeLayer(4, 16, router={"name": router, "capacity_factor": 2.0},
                      dispatch="einsum")
    index.build(x.shape)
    einsum.build(x.shape)
    for source, target in zip(index.weights, einsum.weights, strict=True):
        target.assign(source.value)
    expected = np.asarray(index(x))
    actual = np.asarray(einsum(x))
    others = [0, 2, 3]
    assert np.isfinite(actual[others]).all(), "the NaN image spread to the others"
    np.testing.assert_allclose(actual[others], expected[others], rtol=1e-5, atol=1e-5)


GIB = 2**30


@pytest.fixture
def machine_16gib(monkeypatch):
    monkeypatch.delenv(memory_budget.ALLOW_ENV, raising=False)
    monkeypatch.setattr(memory_budget, "memory_limit", lambda: 16 * GIB)


@pytest.mark.parametrize(
    "make, setting",
    [
        (lambda: SoftMoE(num_experts=4, mlp_dim=8, num_slots=10**9),
         "num_slots=1000000000"),
        (lambda: MoeLayer(num_experts=4, mlp_dim=10**9), "mlp_dim=1000000000"),
    ],
    ids=["soft_moe_slots", "moe_mlp_dim"],
)
def test_giant_layer_is_refused_before_the_first_call(machine_16gib, make, setting):
    layer = make()
    with pytest.raises(memory_budget.MemoryBudgetError) as info:
        layer(np.zeros((1, 4, 16), "float32"))
    assert setting in str(info.value) and "17179869184 bytes" in str(info.value)
