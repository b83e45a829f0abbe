"""`VisionTransformerBackbone`: ViT, V-MoE, Soft MoE and E³ in one model.

Axis letters: B batch, H/W image size, P patch size, T tokens, D hidden,
M MLP size, E experts, N ensemble members, R representation size.
Weight paths are listed in `keras_vmoe.models.vit_layers`.
"""

import copy
import weakref

import keras
import numpy as np
from keras import ops

from keras_vmoe.layers.capacity import validate_capacity_factor
from keras_vmoe.layers.partitioned_moe import tile_for_ensemble
from keras_vmoe.models.lora import LoraMixin
from keras_vmoe.models.moe_config import validate_moe_config
from keras_vmoe.models.size import check_backbone
from keras_vmoe.models.size import in_abstract_build
from keras_vmoe.models.state_guard import RestoreStateOnErrorMixin
from keras_vmoe.models.vit_embeddings import POSITION_EMBEDDINGS
from keras_vmoe.models.vit_embeddings import PatchEmbedding
from keras_vmoe.models.vit_embeddings import PositionEmbedding
from keras_vmoe.models.vit_embeddings import resize_position_embedding
from keras_vmoe.models.vit_embeddings import to_pair
from keras_vmoe.models.vit_layers import LAYER_NORM_EPSILON
from keras_vmoe.models.vit_layers import EncoderBlock
from keras_vmoe.models.vit_layers import MapHead

CLASSIFIERS = ("token", "gap", "map")


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _python_scalar(value):
    """NumPy integers and floats as Python numbers (others unchanged)."""
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def _plain(value):
    """A plain-Python copy of a config value.

    Keras wraps dicts and lists set as attributes of a layer in tracking
    proxies that reference the layer's tracker; `copy.deepcopy` of such a
    proxy copies (serializes) the whole model. Rebuild plain containers
    instead.
    """
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return copy.deepcopy(value)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class VisionTransformerBackbone(LoraMixin, RestoreStateOnErrorMixin, keras.Model):
    """Vision Transformer whose MLP blocks can be Mixture-of-Experts layers.

    One backbone covers the model families of the V-MoE papers: dense ViT,
    V-MoE (sparse Token Choice / Expert Choice MoE layers), Soft MoE and
    E³ efficient ensembles. The graph is

    ```
    images (B, H, W, C) -> patch_embedding [+ cls] -> position_embedding
      -> encoderblock_0 ... encoderblock_{L-1} -> encoder_norm
      -> pool ("token": cls token, "gap": mean, "map": map_head)
      -> [pre_logits Dense(R) + tanh] -> (B, D or R)
    ```

    Blocks listed in `moe_layers` use an MoE layer (`moe`) instead of the
    dense MLP. With `ensemble_size=N > 1` (E³) the tokens are repeated N
    times (member index fastest, `tile_for_ensemble`) before the first MoE
    block, the MoE layers are `PartitionedMoE`, and the output has B·N rows.

    In training the MoE layers add their weighted auxiliary losses with
    `add_loss`, so `model.fit` minimises them with the task loss.

    Args:
        image_size: int or (int, int), input height and width.
        patch_size: int or (int, int), must divide `image_size`.
        hidden_dim: int D.
        num_layers: int L, encoder blocks.
        num_heads: int, attention heads; must divide D.
        mlp_dim: int M of the dense MLPs (and default expert size).
        classifier: `"token"` (class token), `"gap"` (mean of tokens) or
            `"map"` (multihead attention pooling).
        position_embedding: `"learned"`, `"sincos2d"` or `"none"`.
        moe_layers: sequence of 0-based block indices that are MoE blocks.
        moe: dict describing the MoE layers: `num_experts` (required),
            `type` (`"sparse"` (default), `"soft"` or `"partitioned"`),
            `router` (dict of router arguments, e.g. `{"name":
            "token_choice", "num_selected_experts": 2, "capacity_factor":
            1.05}`: the training routing), `group_size` (tokens) or
            `images_per_group`, `eval_routing` (settings that differ when
            `training` is false, e.g. `{"capacity_factor": 4.0}`; see
            `set_routing`), `num_slots` (soft), `bfloat16_dispatch`,
            `dropout_rate` (default: `dropout_rate`), `hidden_dim` (expert
            MLP size, default `mlp_dim`), `identical_init`, `dispatch`.
        ensemble_size: int N of E³; must divide `moe["num_experts"]`.
        qk_norm: bool, LayerNorm on attention queries and keys.
        representation_size: int R, adds a `pre_logits` Dense + tanh.
        dropout_rate: float, dropout after the position embedding, after
            attention and in the MLPs.
        attention_dropout_rate: float, dropout on the attention weights.
        num_channels: int C of the input images.
        dtype: dtype policy of the whole model (e.g. `"mixed_bfloat16"`).
        **kwargs: `keras.Model` arguments (`name`, `trainable`).

    Examples:

    ```python
    import numpy as np
    import keras_vmoe

    backbone = keras_vmoe.models.VisionTransformerBackbone(
        image_size=32, patch_size=8, hidden_dim=64, num_layers=4,
        num_heads=4, mlp_dim=128, moe_layers=(1, 3),
        moe={"num_experts": 4, "router": {"num_selected_experts": 2,
                                          "capacity_factor": 1.05}},
    )
    features = backbone(np.zeros((2, 32, 32, 3)))  # (2, 64)
    backbone.set_routing(capacity_factor=2.0)      # training and evaluation
    backbone.set_routing(capacity_factor=4.0, phase="eval")  # evaluation only
    ```

    References:
        - Riquelme et al., Scaling Vision with Sparse Mixture of Experts,
          https://arxiv.org/abs/2106.05974
        - Puigcerver et al., From Sparse to Soft Mixtures of Experts,
          https://arxiv.org/abs/2308.00951
        - Allingham et al., Sparse MoEs meet Efficient Ensembles,
          https://arxiv.org/abs/2110.03360
    """

    def __init__(
        self,
        image_size=224,
        patch_size=16,
        hidden_dim=768,
        num_layers=12,
        num_heads=12,
        mlp_dim=3072,
        classifier="token",
        position_embedding="learned",
        moe_layers=(),
        moe=None,
        ensemble_size=1,
        qk_norm=False,
        representation_size=None,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        num_channels=3,
        dtype=None,
        **kwargs,
    ):
        image_hw = to_pair(image_size, "image_size")
        patch_hw = to_pair(patch_size, "patch_size")
        moe_layers = tuple(int(i) for i in (moe_layers or ()))
        moe = _plain(dict(moe)) if moe is not None else None
        self._validate(
            image_hw,
            patch_hw,
            hidden_dim,
            num_layers,
            num_heads,
            mlp_dim,
            classifier,
            position_embedding,
            moe_layers,
            moe,
            ensemble_size,
            representation_size,
        )
        # Before any layer exists; abstract builds allocate nothing.
        check_backbone(
            dict(image_size=image_hw, patch_size=patch_hw, hidden_dim=hidden_dim,
                 num_layers=num_layers, num_heads=num_heads, mlp_dim=mlp_dim,
                 moe_layers=moe_layers, moe=moe, ensemble_size=ensemble_size,
                 representation_size=representation_size, num_channels=num_channels,
                 dtype=dtype),
            check_memory=not in_abstract_build(),
        )
        grid = (image_hw[0] // patch_hw[0], image_hw[1] // patch_hw[1])
        use_class_token = classifier == "token"

        # === Layers ===
        patch_embedding = PatchEmbedding(
            hidden_dim,
            patch_hw,
            use_class_token=use_class_token,
            name="patch_embedding",
            dtype=dtype,
        )
        position_layer = PositionEmbedding(
            grid,
            kind=position_embedding,
            has_class_token=use_class_token,
            name="position_embedding",
            dtype=dtype,
        )
        embedding_dropout = keras.layers.Dropout(
            dropout_rate, name="embedding_dropout", dtype=dtype
        )
        blocks = [
            EncoderBlock(
                num_heads,
                mlp_dim,
                moe=moe if i in moe_layers else None,
                ensemble_size=ensemble_size,
                qk_norm=qk_norm,
                dropout_rate=dropout_rate,
                attention_dropout_rate=attention_dropout_rate,
                name=f"encoderblock_{i}",
                dtype=dtype,
            )
            for i in range(num_layers)
        ]
        encoder_norm = keras.layers.LayerNormalization(
            epsilon=LAYER_NORM_EPSILON, name="encoder_norm", dtype=dtype
        )
        map_head = None
        if classifier == "map":
            map_head = MapHead(
                num_heads, mlp_dim, qk_norm=qk_norm, name="map_head", dtype=dtype
            )
        pre_logits = None
        if representation_size:
            pre_logits = keras.layers.Dense(
                representation_size,
                activation="tanh",
                kernel_initializer="lecun_normal",
                name="pre_logits",
                dtype=dtype,
            )

        # === Functional Model ===
        images = keras.Input(shape=(*image_hw, num_channels), name="images")
        x = patch_embedding(images)  # (B, T, D)
        x = position_layer(x)
        x = embedding_dropout(x)
        first_moe = min(moe_layers) if moe_layers else None
        for i, block in enumerate(blocks):
            if ensemble_size > 1 and i == first_moe:
                x = tile_for_ensemble(x, ensemble_size)  # (B·N, T, D)
            x = block(x)
        x = encoder_norm(x)
        if classifier == "token":
            x = x[:, 0]
        elif classifier == "gap":
            x = ops.mean(x, axis=1)
        else:
            x = map_head(x)
        if pre_logits is not None:
            x = pre_logits(x)
        super().__init__(inputs=images, outputs=x, **kwargs)
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)

        # === Config ===
        self.image_size = image_size
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.classifier = classifier
        self.position_embedding = position_embedding
        self.moe_layers = moe_layers
        self.moe = moe
        self.ensemble_size = ensemble_size
        self.qk_norm = qk_norm
        self.representation_size = representation_size
        self.dropout_rate = dropout_rate
        self.attention_dropout_rate = attention_dropout_rate
        self.num_channels = num_channels
        # Untracked caches: jitted routing-metrics functions, and the tasks
        # wrapping this backbone, whose compiled functions must be re-traced
        # when the routing changes (see `set_routing`).
        object.__setattr__(self, "_routing_functions", {})
        object.__setattr__(self, "_routing_dependents", weakref.WeakSet())

    @staticmethod
    def _validate(
        image_hw,
        patch_hw,
        hidden_dim,
        num_layers,
        num_heads,
        mlp_dim,
        classifier,
        position_embedding,
        moe_layers,
        moe,
        ensemble_size,
        representation_size,
    ):
        for axis, (size, patch) in enumerate(zip(image_hw, patch_hw, strict=True)):
            if size < 1 or patch < 1 or size % patch:
                raise ValueError(
                    f"`image_size` must be divisible by `patch_size` (axis {axis}: "
                    f"{size} % {patch} != 0). Received: image_size={image_hw}, "
                    f"patch_size={patch_hw}. Valid image sizes are positive "
                    f"multiples of the patch size, e.g. {max(1, size // max(patch, 1)) * patch}."
                )
        for name, value in (
            ("hidden_dim", hidden_dim),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("mlp_dim", mlp_dim),
        ):
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
                )
        if hidden_dim % num_heads:
            raise ValueError(
                f"`num_heads` must divide `hidden_dim`. Received: num_heads={num_heads}, "
                f"hidden_dim={hidden_dim}. Valid num_heads are the divisors of {hidden_dim}."
            )
        if classifier not in CLASSIFIERS:
            raise ValueError(
                f"`classifier` must be one of {CLASSIFIERS}. Received: classifier={classifier!r}"
            )
        if position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"`position_embedding` must be one of {POSITION_EMBEDDINGS}. "
                f"Received: position_embedding={position_embedding!r}"
            )
        if position_embedding == "sincos2d" and (hidden_dim % 4 or hidden_dim < 8):
            raise ValueError(
                "position_embedding='sincos2d' needs `hidden_dim` to be a multiple of "
                f"4 and >= 8. Received: hidden_dim={hidden_dim}"
            )
        for index in moe_layers:
            if not 0 <= index < num_layers:
                raise ValueError(
                    f"MoE block index {index} in `moe_layers` is out of range: valid "
                    f"indices are 0..{num_layers - 1} for num_layers={num_layers}. "
                    f"Received: moe_layers={moe_layers}"
                )
        if len(set(moe_layers)) != len(moe_layers):
            raise ValueError(
                f"`moe_layers` has duplicates. Received: moe_layers={moe_layers}"
            )
        if not _is_int(ensemble_size) or ensemble_size < 1:
            raise ValueError(
                f"`ensemble_size` must be an integer >= 1. Received: ensemble_size={ensemble_size!r}"
            )
        if moe_layers and moe is None:
            raise ValueError(
                f"`moe_layers={moe_layers}` needs a `moe` dict (at least "
                "{'num_experts': E})."
            )
        if moe is not None:
            validate_moe_config(moe, ensemble_size)
        if ensemble_size > 1 and not moe_layers:
            raise ValueError(
                f"ensemble_size={ensemble_size} (E³) needs at least one MoE block "
                "in `moe_layers`: the ensemble members are formed at the first MoE "
                "block."
            )
        if representation_size is not None and (
            not _is_int(representation_size) or representation_size < 1
        ):
            raise ValueError(
                "`representation_size` must be None or an integer >= 1. "
                f"Received: representation_size={representation_size!r}"
            )

    # --- Structure -----------------------------------------------------

    @property
    def grid_size(self):
        """The patch grid `(H/P, W/P)`."""
        image_hw = to_pair(self.image_size, "image_size")
        patch_hw = to_pair(self.patch_size, "patch_size")
        return (image_hw[0] // patch_hw[0], image_hw[1] // patch_hw[1])

    @property
    def num_tokens(self):
        """Tokens per image T (with the class token when `classifier="token"`)."""
        grid = self.grid_size
        return grid[0] * grid[1] + int(self.classifier == "token")

    @property
    def output_dim(self):
        return self.representation_size or self.hidden_dim

    def get_encoder_blocks(self):
        return [self.get_layer(f"encoderblock_{i}") for i in range(self.num_layers)]

    def get_moe_layers(self):
        """The MoE layers, in block order (`[]` for a dense ViT)."""
        return [
            self.get_layer(f"encoderblock_{i}").moe_layer
            for i in sorted(self.moe_layers)
        ]

    @property
    def moe_type(self):
        if self.moe is None:
            return None
        return validate_moe_config(self.moe, self.ensemble_size)

    # --- Routing -------------------------------------------------------

    def set_routing(
        self,
        num_selected_experts=None,
        capacity_factor=None,
        batch_priority=None,
        group_size=None,
        images_per_group=None,
        phase="both",
    ):
        """Changes the routing of every MoE layer, keeping the weights.

        This is the V-MoE inference-time compute/quality trade-off (e.g. a
        different capacity factor, K or Batch Prioritized Routing at test
        time). The compiled `predict`/`train`/`evaluate` functions of this
        backbone and of the tasks wrapping it are reset so that the next
        call re-traces with the new settings, and the `moe` config is
        updated so that a saved model keeps them.

        A model has a training routing (`moe["router"]`, `group_size`,
        `images_per_group`), used by `fit`, and an evaluation routing, the
        same except for the settings in `moe["eval_routing"]`, used
        whenever the model runs with `training` false (`evaluate`,
        `predict`, plain calls). Presets record both (e.g. fine-tune at
        capacity factor 1.5, evaluate at 4.0).

        Args:
            num_selected_experts: int K, experts per token (Token Choice).
            capacity_factor: float > 0, expert buffer capacity factor.
            batch_priority: bool, Batch Prioritized Routing (Token Choice).
            group_size: int, tokens routed together (for E³ it counts the N
                copies), or `"all"` to route all the tokens of a call as one
                group. Clears `images_per_group`.
            images_per_group: int, images routed together (upstream: 8; E³
                fine-tuning: 128, each with its N copies). Clears
                `group_size`. A batch that is not a whole number of groups
                is padded with masked tokens that take no capacity.
            phase: `"both"` (default: training and evaluation), `"train"`
                (`fit` only) or `"eval"` (`evaluate`/`predict` only).
                Every other argument left `None` keeps its setting.
        """
        requested = {
            name: _python_scalar(value)
            for name, value in (
                ("num_selected_experts", num_selected_experts),
                ("capacity_factor", capacity_factor),
                ("batch_priority", batch_priority),
                ("group_size", group_size),
                ("images_per_group", images_per_group),
            )
            if value is not None
        }
        layers = self.get_moe_layers()
        if not layers:
            raise ValueError(
                "This backbone has no MoE layers (moe_layers=()); there is no "
                "routing to set."
            )
        if phase not in ("both", "train", "eval"):
            raise ValueError(
                "`phase` must be 'both', 'train' or 'eval'. Received: "
                f"phase={phase!r}"
            )
        if not requested:
            return
        if self.moe_type == "soft":
            raise ValueError(
                "Soft MoE layers have a fixed routing (every slot mixes all the "
                "tokens of one image); `set_routing` cannot change "
                f"{sorted(requested)}. Received: {requested}"
            )
        router = layers[0].router
        for name in ("num_selected_experts", "batch_priority"):
            if name in requested and not hasattr(router, name):
                raise ValueError(
                    f"The {type(router).__name__} routers of this model have no "
                    f"`{name}` setting. Received: {name}={requested[name]!r}"
                )
        if "num_selected_experts" in requested:
            value = requested["num_selected_experts"]
            limit = router.experts_per_choice_set
            if not _is_int(value) or not 1 <= value <= limit:
                raise ValueError(
                    f"`num_selected_experts` must be an integer in [1, {limit}]. "
                    f"Received: num_selected_experts={value!r}"
                )
        if "capacity_factor" in requested:
            requested["capacity_factor"] = validate_capacity_factor(
                requested["capacity_factor"]
            )
        if "group_size" in requested and "images_per_group" in requested:
            raise ValueError(
                "Set at most one of `group_size` (tokens) and `images_per_group`. "
                f"Received: group_size={requested['group_size']!r}, "
                f"images_per_group={requested['images_per_group']!r}"
            )
        if "group_size" in requested:
            value = requested["group_size"]
            if value == "all":
                requested["group_size"] = None
            elif not _is_int(value) or value < 1 or value % self.ensemble_size:
                raise ValueError(
                    "`group_size` must be 'all' or an integer >= 1"
                    + (
                        f" divisible by ensemble_size={self.ensemble_size}"
                        if self.ensemble_size > 1
                        else ""
                    )
                    + f". Received: group_size={value!r}"
                )
            requested["images_per_group"] = None
        if "images_per_group" in requested and requested["images_per_group"] is not None:
            value = requested["images_per_group"]
            if not _is_int(value) or value < 1:
                raise ValueError(
                    "`images_per_group` must be an integer >= 1. Received: "
                    f"images_per_group={value!r}"
                )
            requested["group_size"] = None
        for layer in layers:
            layer.update_routing(phase=phase, **requested)

        layer = layers[0]
        moe = _plain(self.moe)
        router_config = dict(moe.get("router") or {})
        for name in ("num_selected_experts", "capacity_factor", "batch_priority"):
            if name in requested:
                router_config[name] = getattr(layer, name)
        if "capacity_factor" in requested and phase != "eval":
            router_config.pop("capacity", None)
        moe["router"] = router_config
        for name in ("group_size", "images_per_group"):
            moe[name] = getattr(layer, name)
        eval_routing = layer.eval_routing
        if eval_routing:
            moe["eval_routing"] = eval_routing
        else:
            moe.pop("eval_routing", None)
        self.moe = moe
        for index in self.moe_layers:
            self.get_layer(f"encoderblock_{index}").moe = _plain(moe)
        self.reset_compiled_functions()

    def reset_compiled_functions(self):
        """Forgets the traced train/test/predict functions (of tasks too)."""
        for model in [self, *list(self._routing_dependents)]:
            model.train_function = None
            model.test_function = None
            model.predict_function = None
        self._routing_functions.clear()

    def _register_routing_dependent(self, model):
        self._routing_dependents.add(model)

    def _run_to_last_moe_block(self, images, training, block_fn):
        """Runs the encoder up to the last MoE block.

        `block_fn(block, x)` runs each MoE block and returns `(x, result)`;
        the results are returned as `{block name: result}`.
        """
        x = self.get_layer("patch_embedding")(images)
        x = self.get_layer("position_embedding")(x)
        x = self.get_layer("embedding_dropout")(x, training=training)
        results = {}
        moe_layers = set(self.moe_layers)
        for i in range(max(moe_layers) + 1):
            if self.ensemble_size > 1 and i == min(moe_layers):
                x = tile_for_ensemble(x, self.ensemble_size)
            block = self.get_layer(f"encoderblock_{i}")
            if i in moe_layers:
                x, results[block.name] = block_fn(block, x)
            else:
                x = block(x, training=training)
        return results

    def _routing_metrics_eager(self, images, training):
        metrics = self._run_to_last_moe_block(
            images,
            training,
            lambda block, x: block(x, training=training, return_metrics=True),
        )
        metrics["auxiliary_loss"] = sum(
            ops.cast(m["auxiliary_loss"], "float32") for m in metrics.values()
        )
        return metrics

    def _routing_assignments_eager(self, images, training):
        def run_block(block, x):
            y, routing = block(x, training=training, return_routing=True)
            result = block.moe_layer.token_assignments(routing, ops.shape(x))
            result["capacity"] = ops.convert_to_tensor(routing.capacity, "int32")
            return y, result

        return self._run_to_last_moe_block(images, training, run_block)

    def routing_metrics(self, images, training=False, jit_compile=True):
        """Per-MoE-block routing metrics for a batch of images.

        Runs the encoder up to the last MoE block with `return_metrics=True`
        (e.g. fraction of dropped tokens, expert fill, experts per token,
        auxiliary losses, capacity).

        Args:
            images: `(B, H, W, C)` array.
            training: bool, route as in training (noise, dropout).
            jit_compile: bool, compile the computation (JAX backend).

        Returns:
            A dict `{"encoderblock_i": {metric: value}, ...,
            "auxiliary_loss": total}` of Python numbers.
        """
        metrics = self._run_routing_analysis("metrics", images, training, jit_compile)
        return keras.tree.map_structure(lambda v: np.asarray(v).item(), metrics)

    def routing_assignments(self, images, training=False, jit_compile=True):
        """Per-token expert assignments of every MoE block for a batch.

        Runs the encoder up to the last MoE block and reads each block's
        `Routing` (see `MoeLayer.token_assignments`). For E³ the rows are
        the B·N member copies (member index fastest).

        Args:
            images: `(B, H, W, C)` array.
            training: bool, route as in training (noise, dropout).
            jit_compile: bool, compile the computation (JAX backend).

        Returns:
            A dict `{"encoderblock_i": {"processed": (B·N, T, E),
            ["requested": (B·N, T, E),] "capacity": int}}` of NumPy
            arrays: slots of each expert holding each token, and (Token
            Choice) the experts each token chose before capacity.
        """
        result = self._run_routing_analysis("assignments", images, training, jit_compile)
        return {
            block: {
                key: int(value) if key == "capacity" else np.asarray(value)
                for key, value in values.items()
            }
            for block, values in result.items()
        }

    def _run_routing_analysis(self, kind, images, training, jit_compile):
        if not self.moe_layers:
            raise ValueError(
                f"This backbone has no MoE layers; there are no routing {kind}."
            )
        images = ops.convert_to_tensor(images, dtype="float32")
        eager = {
            "metrics": self._routing_metrics_eager,
            "assignments": self._routing_assignments_eager,
        }[kind]
        if jit_compile and keras.backend.backend() == "jax":
            return self._routing_jit(kind, eager, images, bool(training))
        return eager(images, training)

    def _routing_jit(self, kind, eager, images, training):
        # jax.jit of a stateless run: Keras has no public jit for an
        # arbitrary function of a model's variables.
        import jax

        variables = list(self.variables)
        key = (kind, training)
        if key not in self._routing_functions:

            def run(values, images):
                mapping = list(zip(variables, values, strict=True))
                with keras.StatelessScope(state_mapping=mapping) as scope:
                    result = eager(images, training)
                updated = [
                    scope.get_current_value(v)
                    if scope.get_current_value(v) is not None
                    else value
                    for v, value in zip(variables, values, strict=True)
                ]
                return result, updated

            self._routing_functions[key] = jax.jit(run)
        result, updated = self._routing_functions[key](
            [v.value for v in variables], images
        )
        for variable, value in zip(variables, updated, strict=True):
            if not variable.trainable:
                variable.assign(value)
        return result

    # --- Weights -------------------------------------------------------

    def load_weights_from(self, source):
        """Copies the weights of another backbone, resizing position embeddings.

        Weights are matched by `variable.path`. A learned position embedding
        whose grid differs (e.g. a 224px model loaded into a 384px one) is
        resized with `resize_position_embedding`. Every weight of this model
        must have a counterpart of the same shape otherwise.

        Args:
            source: a `VisionTransformerBackbone` (or any model with the same
                weight paths).
        """
        source_weights = {v.path: v for v in source.weights}
        for variable in self.weights:
            if variable.path not in source_weights:
                raise ValueError(f"The source model has no weight `{variable.path}`.")
            value = keras.ops.convert_to_numpy(source_weights[variable.path].value)
            if variable.path == "position_embedding/embedding" and value.shape != tuple(
                variable.shape
            ):
                value = resize_position_embedding(
                    value,
                    self.grid_size,
                    has_cls=self.classifier == "token",
                    old_grid=getattr(source, "grid_size", None),
                )
            if value.shape != tuple(variable.shape):
                raise ValueError(
                    f"Shape mismatch for `{variable.path}`: source {value.shape}, "
                    f"target {tuple(variable.shape)}."
                )
            variable.assign(value)

    # --- Distribution --------------------------------------------------

    def get_layout_map(self, device_mesh, layout="expert", batch_size=None):
        """Layout map that splits this backbone over a device mesh.

        Args:
            device_mesh: `keras_vmoe.distribution.make_mesh(...)` mesh with
                axes `("data", "expert", "model")`.
            layout: `"data"`, `"expert"`, `"expert_model"` or `"pod"` (see
                `keras_vmoe.distribution`).
            batch_size: optional global batch size to check as well.

        Returns:
            A `keras.distribution.LayoutMap`, after checking that experts,
            heads, MLP sizes (and the batch) divide the mesh axes.

        Example:

        >>> mesh = keras_vmoe.distribution.make_mesh(data=2, expert=4)  # doctest: +SKIP
        >>> layout_map = backbone.get_layout_map(mesh, "expert")  # doctest: +SKIP
        """
        from keras_vmoe import distribution

        distribution.check_divisible(
            dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True)),
            layout,
            config=self.get_config(),
            batch_size=batch_size,
        )
        return distribution.layout_map(device_mesh, layout)

    # --- Serialization -------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "hidden_dim": self.hidden_dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "mlp_dim": self.mlp_dim,
            "classifier": self.classifier,
            "position_embedding": self.position_embedding,
            "moe_layers": list(self.moe_layers),
            "moe": _plain(self.moe) if self.moe is not None else None,
            "ensemble_size": self.ensemble_size,
            "qk_norm": self.qk_norm,
            "representation_size": self.representation_size,
            "dropout_rate": self.dropout_rate,
            "attention_dropout_rate": self.attention_dropout_rate,
            "num_channels": self.num_channels,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)
