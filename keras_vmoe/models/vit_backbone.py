"""`VisionTransformerBackbone`: ViT, V-MoE, Soft MoE and E³ in one model.

Axis letters: B batch, H/W image size, P patch size, T tokens, D hidden,
M MLP size, E experts, N ensemble members, R representation size.
"""

import keras
from keras import ops

from keras_vmoe.layers.experts import check_activation
from keras_vmoe.layers.layer_norm import LayerNorm
from keras_vmoe.layers.partitioned_moe import tile_for_ensemble
from keras_vmoe.models import features
from keras_vmoe.models import quantized_config
from keras_vmoe.models import routing_analysis
from keras_vmoe.models import routing_control
from keras_vmoe.models import scan as scan_lib
from keras_vmoe.models.backbone import Backbone
from keras_vmoe.models.backbone_arguments import check_epsilon
from keras_vmoe.models.backbone_arguments import migrate_backbone_config
from keras_vmoe.models.backbone_arguments import validate_backbone_arguments
from keras_vmoe.models.moe_config import validate_moe_config
from keras_vmoe.models.remat import check_remat_backend
from keras_vmoe.models.size_estimate import check_backbone
from keras_vmoe.models.size_estimate import in_abstract_build
from keras_vmoe.models.vit_embeddings import PatchEmbedding
from keras_vmoe.models.vit_embeddings import PositionEmbedding
from keras_vmoe.models.vit_embeddings import resize_position_embedding
from keras_vmoe.models.vit_layers import LAYER_NORM_EPSILON
from keras_vmoe.models.vit_layers import EncoderBlock
from keras_vmoe.models.vit_layers import MapHead
from keras_vmoe.utils.initialization import batched_build
from keras_vmoe.utils.validation import check_bool
from keras_vmoe.utils.validation import check_model_kwargs
from keras_vmoe.utils.validation import check_pair
from keras_vmoe.utils.validation import patch_grid
from keras_vmoe.utils.validation import plain

# The constructor arguments `get_config` records, in order.
_CONFIG_ARGUMENTS = (
    "image_size", "patch_size", "hidden_dim", "num_layers", "num_heads", "mlp_dim",
    "classifier", "position_embedding", "moe_layers", "moe", "ensemble_size",
    "qk_norm", "representation_size", "dropout_rate", "attention_dropout_rate",
    "num_channels", "mlp_activation", "layer_norm_epsilon", "pooled_output",
    "remat", "scan",
)


@keras.saving.register_keras_serializable(package="keras_vmoe")
class VisionTransformerBackbone(Backbone):
    """Vision Transformer whose MLP blocks can be Mixture-of-Experts layers.

    One backbone covers the model families of the V-MoE papers: dense ViT,
    V-MoE (sparse Token Choice / Expert Choice MoE layers), Soft MoE and
    E³ efficient ensembles. The graph is

    ```
    images (B, H, W, C) -> patch_embedding [+ cls] -> position_embedding
      -> encoderblock_0 ... encoderblock_{L-1} -> encoder_norm  (B, T, D)
      -> pool ("token": cls token, "gap": mean, "map": map_head)
      -> [pre_logits Dense(R) + tanh] -> (B, D or R)
    ```

    `token_output` (the symbolic `(B, T, D)` tokens) and `block_outputs`
    (each block's symbolic output) serve feature models. With
    `ensemble_size=N > 1` (E³) the tokens are repeated N times (member index
    fastest) before the first MoE block and the output has B·N rows. MoE
    layers add their auxiliary losses with `add_loss` in training.

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
        moe: dict of the MoE layers: `num_experts` (required), `type`
            (`"sparse"`, `"soft"` or `"partitioned"`), `router` (router
            arguments, the training routing), `group_size` or
            `images_per_group`, `eval_routing` (settings that differ when
            not training), `num_slots` (soft), `bfloat16_dispatch`,
            `dropout_rate`, `mlp_dim` (expert MLP size),
            `identical_init`, `dispatch`.
        ensemble_size: int N of E³; must divide `moe["num_experts"]`.
        qk_norm: bool, LayerNorm on attention queries and keys.
        representation_size: int R, adds a `pre_logits` Dense + tanh.
        dropout_rate: float, dropout after the position embedding, after
            attention and in the MLPs.
        attention_dropout_rate: float, dropout on the attention weights.
        num_channels: int C of the input images.
        mlp_activation: `"gelu_tanh"` (upstream's tanh-approximated GELU)
            or `"gelu"` (exact, as in timm and transformers ViTs).
        layer_norm_epsilon: float, epsilon of every LayerNorm (transformers
            ViTs: 1e-12).
        pooled_output: bool, pool the tokens (default) or return the
            `(B, T, D)` token sequence (no `map_head` nor `pre_logits`).
        remat: bool, recompute every encoder block's activations in the
            backward pass (gradient checkpointing; JAX, PyTorch, TensorFlow).
        scan: bool, run repeated encoder blocks as `jax.lax.scan`s (JAX):
            compile time no longer grows with depth; weights and outputs
            are unchanged.
        dtype: dtype policy of the whole model (e.g. `"mixed_bfloat16"`).
        **kwargs: `keras.Model` arguments (`name`, `trainable`).

    Examples:

    ```python
    import keras
    import numpy as np
    import keras_vmoe

    backbone = keras_vmoe.models.VisionTransformerBackbone(
        image_size=32, patch_size=8, hidden_dim=64, num_layers=4,
        num_heads=4, mlp_dim=128, moe_layers=(1, 3),
        moe={"num_experts": 4, "router": {"num_selected_experts": 2,
                                          "capacity_factor": 1.05}},
    )
    features = backbone(np.zeros((2, 32, 32, 3)))  # (2, 64)
    tokens = backbone.extract_features(np.zeros((2, 32, 32, 3)), blocks=-1,
                                       norm=True)  # {"encoderblock_3": (2, 17, 64)}
    backbone.set_routing(capacity_factor=2.0)      # training and evaluation
    backbone.set_routing(capacity_factor=4.0, phase="eval")  # evaluation only
    backbone.set_remat(True)  # recompute each block's activations in backward
    if keras.config.backend() == "jax":
        backbone.set_scan(True)  # one compiled block per repeated segment
    ```

    References:
        - Riquelme et al., Scaling Vision with Sparse Mixture of Experts,
          https://arxiv.org/abs/2106.05974
        - Puigcerver et al., From Sparse to Soft Mixtures of Experts,
          https://arxiv.org/abs/2308.00951
        - Allingham et al., Sparse MoEs meet Efficient Ensembles,
          https://arxiv.org/abs/2110.03360
    """

    @batched_build  # on JAX, every random weight drawn in one XLA program
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
        mlp_activation="gelu_tanh",
        layer_norm_epsilon=LAYER_NORM_EPSILON,
        pooled_output=True,
        remat=False,
        scan=False,
        dtype=None,
        **kwargs,
    ):
        check_model_kwargs(type(self), kwargs)
        mlp_activation = check_activation(mlp_activation)
        layer_norm_epsilon = check_epsilon(layer_norm_epsilon)
        image_hw = check_pair(image_size, "image_size")
        patch_hw = check_pair(patch_size, "patch_size")
        moe_layers = tuple(int(i) for i in (moe_layers or ()))
        moe = plain(dict(moe)) if moe is not None else None
        validate_backbone_arguments(
            image_hw, patch_hw, hidden_dim, num_layers, num_heads, mlp_dim, classifier,
            position_embedding, moe_layers, moe, ensemble_size, representation_size)
        pooled = bool(pooled_output)
        # Abstract builds allocate nothing, so only the sizes are checked there.
        check_backbone(
            dict(image_size=image_hw, patch_size=patch_hw, hidden_dim=hidden_dim,
                 num_layers=num_layers, num_heads=num_heads, mlp_dim=mlp_dim,
                 classifier=classifier, moe_layers=moe_layers, moe=moe,
                 ensemble_size=ensemble_size,
                 representation_size=representation_size if pooled else None,
                 num_channels=num_channels, dtype=dtype),
            check_memory=not in_abstract_build())
        remat = check_bool(remat, "remat")
        check_remat_backend(remat)
        scan = check_bool(scan, "scan")
        scan_lib.check_scan_backend(scan)
        layers = _make_layers(
            image_hw, patch_hw, hidden_dim, num_layers, num_heads, mlp_dim,
            classifier, position_embedding, moe_layers, moe, ensemble_size, qk_norm,
            representation_size, dropout_rate, attention_dropout_rate, pooled, remat,
            dtype, mlp_activation, layer_norm_epsilon)
        images = keras.Input(shape=(*image_hw, num_channels), name="images")
        x, tokens, block_outputs = _encode(images, layers, moe_layers, ensemble_size,
                                           classifier, pooled)
        super().__init__(inputs=images, outputs=x, **kwargs)
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)
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
        self.mlp_activation = mlp_activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.pooled_output = pooled
        self.remat = remat
        self.scan = scan
        object.__setattr__(self, "token_output", tokens)
        object.__setattr__(self, "block_outputs", block_outputs)

    @property
    def grid_size(self):
        """The patch grid `(H/P, W/P)`."""
        return patch_grid(self.image_size, self.patch_size)

    @property
    def num_tokens(self):
        """Tokens per image T (with the class token when `classifier="token"`)."""
        grid = self.grid_size
        return grid[0] * grid[1] + int(self.classifier == "token")

    @property
    def output_dim(self):
        """Size of the last axis of the model's output."""
        if not self.pooled_output:
            return self.hidden_dim
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

    def extract_features(self, images, blocks=None, **kwargs):
        """Token sequences of chosen encoder blocks (and their routing).

        `images` may be what a task's `predict` takes. See
        `keras_vmoe.models.features.extract_features` for the arguments.

        Returns:
            `{"encoderblock_i": (B, T, D) or (B, h, w, D) array}` (and the
            routing of the MoE blocks with `return_routing=True`).
        """
        return features.extract_features(self, images, blocks=blocks, **kwargs)

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

        The `moe` config records the change and the compiled functions of
        this backbone and its tasks are reset. The evaluation routing (used
        whenever `training` is false) is the training one except for the
        settings in `moe["eval_routing"]`.

        Args:
            num_selected_experts: int K, experts per token (Token Choice).
            capacity_factor: float > 0, expert buffer capacity factor.
            batch_priority: bool, Batch Prioritized Routing (Token Choice).
            group_size: int, tokens routed together (E³: with the N
                copies), or `"all"`. Clears `images_per_group`.
            images_per_group: int, images routed together. Clears
                `group_size`.
            phase: `"both"` (default), `"train"` or `"eval"`. Arguments
                left `None` keep their setting.
        """
        routing_control.set_routing(
            self, phase, num_selected_experts=num_selected_experts,
            capacity_factor=capacity_factor, batch_priority=batch_priority,
            group_size=group_size, images_per_group=images_per_group)

    def set_remat(self, remat):
        """Switches rematerialisation of every encoder block, keeping the
        weights; the compiled functions are reset.

        Args:
            remat: bool.
        """
        remat = check_bool(remat, "remat")
        check_remat_backend(remat)
        for block in self.get_encoder_blocks():
            block.remat = remat
        self.remat = remat
        self.reset_compiled_functions()

    def set_scan(self, scan):
        """Switches the scanned encoder (JAX), keeping the weights; the
        compiled functions are reset.

        Args:
            scan: bool.
        """
        scan = check_bool(scan, "scan")
        scan_lib.check_scan_backend(scan)
        self.scan = scan
        self.reset_compiled_functions()

    def call(self, inputs, training=None, mask=None, **kwargs):
        """The functional graph, with repeated blocks scanned when `scan` is on."""
        if getattr(self, "scan", False):
            return scan_lib.scanned_call(self, inputs, training=training)
        return super().call(inputs, training=training, mask=mask, **kwargs)

    def reset_compiled_functions(self):
        """Forgets the traced train/test/predict functions (of tasks too)."""
        routing_control.reset_compiled_functions(self)

    def _register_routing_dependent(self, model):
        routing_control.register_routing_dependent(self, model)

    def routing_metrics(self, images, training=False, jit_compile=True):
        """Per-MoE-block routing metrics (dropped tokens, expert fill,
        auxiliary losses, ...) for a batch of images.

        Args:
            images: `(B, H, W, C)` array.
            training: bool, route as in training (noise, dropout).
            jit_compile: bool, compile the computation (JAX backend).

        Returns:
            A dict `{"encoderblock_i": {metric: value}, ...,
            "auxiliary_loss": total}` of Python numbers.
        """
        return routing_analysis.routing_metrics(self, images, training, jit_compile)

    def routing_assignments(self, images, training=False, jit_compile=True):
        """Per-token expert assignments of every MoE block for a batch (E³:
        B·N rows, member index fastest).

        Args:
            images: `(B, H, W, C)` array.
            training: bool, route as in training (noise, dropout).
            jit_compile: bool, compile the computation (JAX backend).

        Returns:
            `{"encoderblock_i": {"processed": (B·N, T, E), ["requested": (B·N,
            T, E),] "capacity": int}}` of NumPy arrays (see
            `routing_analysis.token_assignments`).
        """
        return routing_analysis.routing_assignments(self, images, training, jit_compile)

    def load_weights_from(self, source):
        """Copies the weights of `source` (matched by path) into this backbone.

        A learned position embedding of another grid is resized; every other
        weight must have the same shape.

        Args:
            source: a `VisionTransformerBackbone` (or any model with the
                same weight paths).
        """
        source_weights = {v.path: v for v in source.weights}
        for variable in self.weights:
            if variable.path not in source_weights:
                raise ValueError(f"The source model has no weight `{variable.path}`.")
            value = keras.ops.convert_to_numpy(source_weights[variable.path].value)
            shape = tuple(variable.shape)
            if variable.path == "position_embedding/embedding" and value.shape != shape:
                value = resize_position_embedding(
                    value, self.grid_size, has_cls=self.classifier == "token",
                    old_grid=getattr(source, "grid_size", None))
            if value.shape != shape:
                raise ValueError(
                    f"Shape mismatch for `{variable.path}`: source {value.shape}, "
                    f"target {shape}.")
            variable.assign(value)

    def get_config(self):
        config = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": keras.dtype_policies.serialize(self.dtype_policy),
            **{name: getattr(self, name) for name in _CONFIG_ARGUMENTS},
        }
        config["moe_layers"] = list(self.moe_layers)
        config["moe"] = plain(self.moe) if self.moe is not None else None
        return quantized_config.add_quantized_layers(config, self)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layers = quantized_config.pop_quantized_layers(config)
        return quantized_config.quantize_layers(
            cls(**migrate_backbone_config(config)), layers)


def _make_layers(image_hw, patch_hw, hidden_dim, num_layers, num_heads, mlp_dim,
                 classifier, position_embedding, moe_layers, moe, ensemble_size,
                 qk_norm, representation_size, dropout_rate, attention_dropout_rate,
                 pooled, remat, dtype, mlp_activation="gelu_tanh",
                 layer_norm_epsilon=LAYER_NORM_EPSILON):
    """The backbone's layers by role (`map_head`/`pre_logits` None when unused)."""
    grid = patch_grid(image_hw, patch_hw)
    use_class_token = classifier == "token"
    layers = {
        "patch_embedding": PatchEmbedding(
            hidden_dim, patch_hw, use_class_token=use_class_token,
            name="patch_embedding", dtype=dtype),
        "position_embedding": PositionEmbedding(
            grid, kind=position_embedding, has_class_token=use_class_token,
            name="position_embedding", dtype=dtype),
        "embedding_dropout": keras.layers.Dropout(
            dropout_rate, name="embedding_dropout", dtype=dtype),
        "blocks": [
            EncoderBlock(
                num_heads, mlp_dim, moe=moe if i in moe_layers else None,
                ensemble_size=ensemble_size, qk_norm=qk_norm,
                dropout_rate=dropout_rate,
                attention_dropout_rate=attention_dropout_rate, remat=remat,
                mlp_activation=mlp_activation, layer_norm_epsilon=layer_norm_epsilon,
                name=f"encoderblock_{i}", dtype=dtype)
            for i in range(num_layers)
        ],
        "encoder_norm": LayerNorm(
            epsilon=layer_norm_epsilon, name="encoder_norm", dtype=dtype),
        "map_head": None,
        "pre_logits": None,
    }
    if pooled and classifier == "map":
        layers["map_head"] = MapHead(
            num_heads, mlp_dim, qk_norm=qk_norm, mlp_activation=mlp_activation,
            layer_norm_epsilon=layer_norm_epsilon, name="map_head", dtype=dtype)
    if pooled and representation_size:
        layers["pre_logits"] = keras.layers.Dense(
            representation_size, activation="tanh", kernel_initializer="lecun_normal",
            name="pre_logits", dtype=dtype)
    return layers


def _encode(images, layers, moe_layers, ensemble_size, classifier, pooled):
    """Returns `(output, tokens after encoder_norm, {block name: output})`."""
    x = layers["patch_embedding"](images)  # (B, T, D)
    x = layers["position_embedding"](x)
    x = layers["embedding_dropout"](x)
    first_moe = min(moe_layers) if moe_layers else None
    block_outputs = {}
    for i, block in enumerate(layers["blocks"]):
        if ensemble_size > 1 and i == first_moe:
            x = tile_for_ensemble(x, ensemble_size)  # (B·N, T, D)
        x = block(x)
        block_outputs[block.name] = x
    tokens = layers["encoder_norm"](x)  # (B[·N], T, D)
    if not pooled:
        return tokens, tokens, block_outputs
    if classifier == "token":
        x = tokens[:, 0]  # (B[·N], D)
    elif classifier == "gap":
        x = ops.mean(tokens, axis=1)  # (B[·N], D)
    else:
        x = layers["map_head"](tokens)  # (B[·N], D)
    if layers["pre_logits"] is not None:
        x = layers["pre_logits"](x)  # (B[·N], R)
    return x, tokens, block_outputs
