"""Catalog of built-in presets: name -> architecture, routing, weights, metadata.

This module is data only. Every entry of `PRESETS` has:

* `description`: one line for `list_presets()` and model cards.
* `family`, `variant`, `overrides`: the arguments of
  `keras_vmoe.models.configs.backbone_config(family, variant, **overrides)`
  that give the backbone constructor arguments (the image size is added
  from `image_size`).
* `image_size`: the input resolution the weights (or the paper) use.
* `task`: `{"kind": "classifier" | "ensemble_classifier", "num_classes",
  "head_bias_init"}`, the head put on the backbone.
* `routing`: the routing of the MoE layers at load time (the
  `backbone.set_routing` arguments): `num_selected_experts` (K),
  `capacity_factor` (the evaluation value upstream uses), `group_size` and
  `batch_priority` (BPR). Empty for dense and Soft MoE models.
  `group_size` is `None` (all the tokens of a call form one routing group)
  so that any batch size works; upstream routes groups of 8 images' tokens
  (times the ensemble size for E³), recorded as
  `metadata["upstream_group_size"]`: pass `group_size=...` to `from_preset`
  (with batches of a multiple of 8 images) to reproduce it exactly.
* `weights`: `None` for architectures without released weights, else
  `{"format": "vmoe_partitioned" | "vit_npz", "upstream": "gs://..."}`.
  `vmoe_partitioned` is the checkpoint prefix (files `<prefix>.index` and
  `<prefix>.data-*`) of google-research/vmoe; `vit_npz` a `.npz` file of
  google-research/vision_transformer.
* `metadata`: `paper` (arXiv id), `params` (exact parameter count of the
  preset's model), `paper_params` (as printed in the paper, when the
  preset reproduces a paper model), `dataset`, `accuracy` (as reported,
  in %), `source` (where the facts come from) and `notes`.

`ALIASES` maps short names (e.g. `vmoe_b32`) to catalog names.

Facts come from the papers (V-MoE arXiv:2106.05974 Table 8; Soft MoE
arXiv:2308.00951 Table 1 and its configs; E³ arXiv:2110.03360 Tables 20,
23, 25) and from the google-research/vmoe and vision_transformer READMEs
and configs. Values marked "assumed" in `notes` are not stated upstream.
"""

VMOE_PAPER = "arXiv:2106.05974"
SOFT_MOE_PAPER = "arXiv:2308.00951"
EEE_PAPER = "arXiv:2110.03360"
VIT_PAPER = "arXiv:2010.11929"
AUGREG_PAPER = "arXiv:2106.10270"

VMOE_BUCKET = "gs://vmoe_checkpoints"
VIT_BUCKET = "gs://vit_models"

# Head bias initialisations used upstream: -log(num_classes) or -10.
_BIAS_1K = -6.907755  # -log(1000)
_BIAS_JFT300M = -9.814164  # -log(18291)
_BIAS_JFT4B = -10.295293  # -log(29593)

_JFT300M_NOTE = (
    "Architecture of the paper's JFT-300M upstream model (18,291-class head, "
    "pre-logits of size D, 224px, E=32, K=2, C=1.05). No weights were released; "
    "pass num_classes=... to put a new head on it."
)
_SOFT_MOE_NOTE = (
    "Architecture of the paper's JFT-4B model (29,593-class head, GAP, "
    "qk-norm, Soft MoE in the last half of the blocks, one slot per expert). "
    "No weights were released."
)
_EEE_NOTE = (
    "E³ (K=1, M=2) fine-tuned on ImageNet at 384px from a JFT-300M V-MoE "
    "(E=32); train capacity 1.5, eval capacity 8. No weights were released. "
    "Predictions are the mean of the members' probabilities."
)

PRESETS = {
    # ------------------------------------------------------------------
    # Released google-research/vmoe checkpoints (gs://vmoe_checkpoints).
    # ------------------------------------------------------------------
    "vmoe_s32_last2_ilsvrc2012_randaug_light1": {
        "description": (
            "V-MoE S/32 Last-2, E=8, K=2, trained from scratch on ImageNet-1k "
            "(300 epochs, RandAugment light1), 224px."
        ),
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {"layout": "last2", "num_experts": 8, "representation_size": 512},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": _BIAS_1K},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 4.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/vmoe_s32_last2_ilsvrc2012_randaug_light1",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 56_999_400,
            "upstream_group_size": 400,
            "accuracy": {"val": 76.8, "test": 73.1, "real": 74.4, "v2": 59.2},
            "source": "google-research/vmoe README and "
            "configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1.py",
            "train_capacity_factor": 1.05,
            "notes": "Trained with capacity factor 1.05 and MoE dropout 0.2; the "
            "upstream config evaluates with capacity factor 4.0 (used here). "
            "upstream_group_size = 8 images x 50 tokens.",
        },
    },
    "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012": {
        "description": (
            "V-MoE S/32 Last-2, E=8, K=2, ImageNet-1k light1 model fine-tuned "
            "on ImageNet-1k at 384px."
        ),
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {"layout": "last2", "num_experts": 8, "representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": _BIAS_1K},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.5,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/"
            "vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 56_785_384,
            "upstream_group_size": 1160,
            "accuracy": {"test": 75.9, "real": 77.1, "v2": 62.0},
            "source": "google-research/vmoe README and "
            "configs/vmoe_paper/vmoe_s32_last2_ilsvrc2012_randaug_light1_ft_ilsvrc2012.py",
            "notes": "No pre-logits layer. upstream_group_size = 8 images x 145 tokens.",
        },
    },
    "vmoe_s32_last2_ilsvrc2012_randaug_medium": {
        "description": (
            "V-MoE S/32 Last-2, E=8, trained from scratch on ImageNet-1k "
            "(1000 epochs, RandAugment medium), 224px."
        ),
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {"layout": "last2", "num_experts": 8, "representation_size": 512},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": _BIAS_1K},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/vmoe_s32_last2_ilsvrc2012_randaug_medium",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 56_999_400,
            "upstream_group_size": 400,
            "accuracy": None,
            "source": "google-research/vmoe README (2022-01); no config in the repo",
            "notes": "Architecture assumed equal to the light1 model (K=2, "
            "pre-logits 512, 1000 classes); upstream publishes no config for it.",
        },
    },
    "vmoe_b16_imagenet21k_randaug_strong": {
        "description": (
            "V-MoE B/16 Every-2, E=8, K=2, trained on ImageNet-21k (300 "
            "epochs, RandAugment strong), 224px, 21,843 classes."
        ),
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {
            "layout": "every2",
            "num_experts": 8,
            "representation_size": None,
        },
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": -10.0},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/vmoe_b16_imagenet21k_randaug_strong",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "ImageNet-21k",
            "params": 300_974_931,
            "upstream_group_size": 1576,
            "accuracy": None,
            "source": "google-research/vmoe README and "
            "configs/vmoe_paper/pretrain_imagenet21k.py",
            "notes": "Sigmoid cross-entropy; upstream_group_size = 8 images x 197 tokens.",
        },
    },
    "vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012": {
        "description": (
            "V-MoE B/16 Every-2, E=8, K=2, ImageNet-21k model fine-tuned on "
            "ImageNet-1k at 384px."
        ),
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {
            "layout": "every2",
            "num_experts": 8,
            "representation_size": None,
        },
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": _BIAS_1K},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.5,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 285_238_504,
            "upstream_group_size": 4616,
            "accuracy": {"val": 89.2, "test": 85.6, "real": 84.1, "v2": 76.1},
            "source": "google-research/vmoe README and "
            "configs/vmoe_paper/vmoe_b16_imagenet21k_randaug_strong_ft_ilsvrc2012.py",
            "notes": "upstream_group_size = 8 images x 577 tokens (the 2022 configs used 4 "
            "images).",
        },
    },
    "vmoe_b16_imagenet21k_randaug_strong_ft_cifar10": {
        "description": (
            "V-MoE B/16 Every-2, E=8, K=2, ImageNet-21k model fine-tuned on "
            "CIFAR-10 at 128px (unlisted upstream checkpoint)."
        ),
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {
            "layout": "every2",
            "num_experts": 8,
            "representation_size": None,
        },
        "image_size": 128,
        "task": {"kind": "classifier", "num_classes": 10, "head_bias_init": -10.0},
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.5,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/vmoe_b16_imagenet21k_randaug_strong_ft_cifar10",
        },
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "CIFAR-10",
            "params": 284_083_978,
            "upstream_group_size": 520,
            "accuracy": {"test": 98.7},
            "source": "configs/vmoe_paper/"
            "vmoe_b16_imagenet21k_randaug_strong_ft_cifar10.py; google-research/vmoe "
            "issue #14",
            "notes": "Not listed in the upstream README; its existence in the bucket "
            "is unverified. upstream_group_size (8 images x 65 tokens) and head bias are "
            "assumed.",
            "unverified": True,
        },
    },
    "eee_s32_last2_ilsvrc2012": {
        "description": (
            "E³ S/32 Last-2, E=8 split between M=2 members, trained from "
            "scratch on ImageNet-1k, 224px."
        ),
        "family": "eee",
        "variant": "S/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 8,
            "ensemble_size": 2,
            "representation_size": 512,
        },
        "image_size": 224,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 1.5,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/eee_s32_last2_ilsvrc2012",
        },
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 56_999_400,
            "upstream_group_size": 800,
            "accuracy": None,
            "source": "google-research/vmoe README; no pretraining config upstream",
            "notes": "K=1, pre-logits 512, head bias and routing assumed from the "
            "CIFAR-100 fine-tuning config. upstream_group_size = 8 images x 50 tokens x 2 "
            "members. The paper (App. K) reports error 23.78 for this recipe.",
        },
    },
    "eee_s32_last2_ilsvrc2012_ft_cifar100": {
        "description": (
            "E³ S/32 Last-2, E=8 split between M=2 members, ImageNet-1k model "
            "fine-tuned on CIFAR-100 at 128px."
        ),
        "family": "eee",
        "variant": "S/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 8,
            "ensemble_size": 2,
            "representation_size": 512,
        },
        "image_size": 128,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 100,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 1.5,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": {
            "format": "vmoe_partitioned",
            "upstream": f"{VMOE_BUCKET}/eee_s32_last2_ilsvrc2012_ft_cifar100",
        },
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "CIFAR-100",
            "params": 56_520_804,
            "upstream_group_size": 4352,
            "accuracy": {"test": 81.26},
            "source": "configs/eee_paper/eee_s32_last2_ilsvrc2012_ft_cifar100.py and "
            "notebooks/demo_eee_CIFAR100.ipynb",
            "notes": "upstream_group_size = 128 images x 17 tokens x 2 members (upstream "
            "per-device batch); the config reports 81.31% mean test accuracy.",
        },
    },
    # ------------------------------------------------------------------
    # V-MoE paper architectures (Table 8), no released weights.
    # ------------------------------------------------------------------
    "vmoe_s32_last2": {
        "description": "V-MoE S/32 Last-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {"layout": "last2", "num_experts": 32, "representation_size": 512},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 166_680_435,
            "upstream_group_size": 400,
            "paper_params": "166.7M",
            "accuracy": {"jft_p1": 33.26, "in_10shot": 54.16, "in_finetune": 77.10},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_s32_every2": {
        "description": "V-MoE S/32 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 512,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 296_895_347,
            "upstream_group_size": 400,
            "paper_params": "296.9M",
            "accuracy": {"jft_p1": 34.00, "in_10shot": 54.97, "in_finetune": 77.08},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_b32_last2": {
        "description": "V-MoE B/32 Last-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/32",
        "overrides": {"layout": "last2", "num_experts": 32, "representation_size": 768},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 394_951_539,
            "upstream_group_size": 400,
            "paper_params": "395.0M",
            "accuracy": {"jft_p1": 43.17, "in_10shot": 65.72, "in_finetune": 82.60},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_b32_every2": {
        "description": "V-MoE B/32 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/32",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 768,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 980_631_411,
            "upstream_group_size": 400,
            "paper_params": "980.6M",
            "accuracy": {"jft_p1": 43.37, "in_10shot": 65.94, "in_finetune": 82.21},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_b16_last2": {
        "description": "V-MoE B/16 Last-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {"layout": "last2", "num_experts": 32, "representation_size": 768},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 393_294_963,
            "upstream_group_size": 1576,
            "paper_params": "393.3M",
            "accuracy": {"jft_p1": 48.31, "in_10shot": 71.81, "in_finetune": 85.39},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_b16_every2": {
        "description": "V-MoE B/16 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 768,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 978_974_835,
            "upstream_group_size": 1576,
            "paper_params": "979.0M",
            "accuracy": {"jft_p1": 49.31, "in_10shot": 72.50, "in_finetune": 85.26},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_l32_last2": {
        "description": "V-MoE L/32 Last-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "representation_size": 1024,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 845_784_947,
            "upstream_group_size": 400,
            "paper_params": "845.8M",
            "accuracy": {"jft_p1": 49.68, "in_10shot": 72.80, "in_finetune": 85.04},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_l32_every2": {
        "description": "V-MoE L/32 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/32",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 1024,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 3_448_168_307,
            "upstream_group_size": 400,
            "paper_params": "3448.2M",
            "accuracy": {"jft_p1": 49.31, "in_10shot": 72.02, "in_finetune": 84.81},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_l16_last2": {
        "description": "V-MoE L/16 Last-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/16",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "representation_size": 1024,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 843_576_179,
            "upstream_group_size": 1576,
            "paper_params": "843.6M",
            "accuracy": {"jft_p1": 56.76, "in_10shot": 78.64, "in_finetune": 87.54},
            "source": "V-MoE paper Table 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_l16_every2": {
        "description": "V-MoE L/16 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/16",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 1024,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 3_445_959_539,
            "upstream_group_size": 1576,
            "paper_params": "3446.0M",
            "accuracy": {"jft_p1": 57.65, "in_10shot": 79.01, "in_finetune": 87.41},
            "source": "V-MoE paper Tables 2 and 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_h14_last5": {
        "description": "V-MoE H/14 Last-5 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "H/14",
        "overrides": {
            "layout": "last5",
            "num_experts": 32,
            "representation_size": 1280,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 2_688_648_051,
            "upstream_group_size": 2056,
            "paper_params": "2688.6M",
            "accuracy": {"jft_p1": 60.12, "in_10shot": 80.10, "in_finetune": 88.23},
            "source": "V-MoE paper Tables 2 and 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_h14_every2": {
        "description": "V-MoE H/14 Every-2 (E=32, K=2) on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "H/14",
        "overrides": {
            "layout": "every2",
            "num_experts": 32,
            "representation_size": 1280,
        },
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 7_160_836_211,
            "upstream_group_size": 2056,
            "paper_params": "7160.8M",
            "accuracy": {"jft_p1": 60.62, "in_10shot": 80.33, "in_finetune": 88.36},
            "source": "V-MoE paper Tables 2 and 8",
            "notes": _JFT300M_NOTE,
        },
    },
    "vmoe_15b": {
        "description": (
            "V-MoE-15B Every-2 (48 blocks, D=1408, E=32, K=2) on JFT-3B; "
            "architecture only."
        ),
        "family": "vmoe_15b",
        "variant": "15B",
        "overrides": {},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {
            "num_selected_experts": 2,
            "capacity_factor": 1.05,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-3B",
            "params": 14_731_038_873,
            "paper_params": "14705.1M",
            "accuracy": {"in_10shot": 84.29, "in_finetune": 90.35},
            "source": "V-MoE paper §3.6, App. B.3, Tables 2 and 8",
            "notes": "The paper does not give the patch size or the exact head "
            "(MAP head, ~30k JFT-3B classes); the backbone_config defaults are "
            "used and the 29,593-class head is an assumption. The ImageNet "
            "fine-tune ran at 560px.",
        },
    },
    # V-MoE paper dense ViT baselines (Table 8; V-MoE sizes, S has 8 blocks).
    "vmoe_dense_s32": {
        "description": "Dense ViT-S/32 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "S/32",
        "overrides": {"layout": "none", "representation_size": 512},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 36_465_523,
            "paper_params": "36.5M",
            "accuracy": {"jft_p1": 29.05, "in_10shot": 46.38, "in_finetune": 73.73},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    "vmoe_dense_b32": {
        "description": "Dense ViT-B/32 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/32",
        "overrides": {"layout": "none", "representation_size": 768},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 102_111_603,
            "paper_params": "102.1M",
            "accuracy": {"jft_p1": 39.31, "in_10shot": 59.63, "in_finetune": 80.73},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    "vmoe_dense_b16": {
        "description": "Dense ViT-B/16 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "B/16",
        "overrides": {"layout": "none", "representation_size": 768},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 100_455_027,
            "paper_params": "100.5M",
            "accuracy": {"jft_p1": 44.58, "in_10shot": 66.94, "in_finetune": 84.15},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    "vmoe_dense_l32": {
        "description": "Dense ViT-L/32 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/32",
        "overrides": {"layout": "none", "representation_size": 1024},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 325_308_275,
            "paper_params": "325.3M",
            "accuracy": {"jft_p1": 46.98, "in_10shot": 69.77, "in_finetune": 84.37},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    "vmoe_dense_l16": {
        "description": "Dense ViT-L/16 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "L/16",
        "overrides": {"layout": "none", "representation_size": 1024},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 323_099_507,
            "paper_params": "323.1M",
            "accuracy": {"jft_p1": 53.4, "in_10shot": 76.62, "in_finetune": 87.12},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    "vmoe_dense_h14": {
        "description": "Dense ViT-H/14 baseline of the V-MoE paper on JFT-300M, 224px; architecture only.",
        "family": "vmoe",
        "variant": "H/14",
        "overrides": {"layout": "none", "representation_size": 1280},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 18291,
            "head_bias_init": _BIAS_JFT300M,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": VMOE_PAPER,
            "dataset": "JFT-300M",
            "params": 655_835_251,
            "paper_params": "655.8M",
            "accuracy": {"jft_p1": 56.68, "in_10shot": 79.02, "in_finetune": 88.08},
            "source": "V-MoE paper Table 8",
            "notes": "Dense baseline with the V-MoE sizes (ViT-S here is D=512, 8 blocks); "
            "no weights were released.",
        },
    },
    # ------------------------------------------------------------------
    # Soft MoE paper architectures (no released weights).
    # ------------------------------------------------------------------
    "soft_moe_s16_128e": {
        "description": "Soft MoE S/16, 128 experts in the last 6 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "S/16",
        "overrides": {"num_experts": 128},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 933_709_471,
            "paper_params": "933M",
            "accuracy": {"lit_in_0shot": 81.2},
            "source": "Soft MoE paper Table 3 and projects/soft_moe/configs",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_s14_256e": {
        "description": "Soft MoE S/14, 256 experts in the last 6 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "S/14",
        "overrides": {"num_experts": 256},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 1_841_402_527,
            "paper_params": "1.8B",
            "accuracy": {"jft_p1": 60.1, "in_10shot": 80.6, "in_finetune": 87.5},
            "source": "Soft MoE paper Table 1",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_b16_128e": {
        "description": "Soft MoE B/16, 128 experts in the last 6 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "B/16",
        "overrides": {"num_experts": 128},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 3_707_638_687,
            "paper_params": "3.7B",
            "accuracy": {"jft_p1": 62.4, "in_10shot": 82.9, "in_finetune": 88.5},
            "source": "Soft MoE paper Table 1",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_l16_128e": {
        "description": "Soft MoE L/16, 128 experts in the last 12 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "L/16",
        "overrides": {"num_experts": 128},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 13_127_249_829,
            "paper_params": "13.1B",
            "accuracy": {"jft_p1": 63.0, "in_10shot": 84.3, "in_finetune": 89.2},
            "source": "Soft MoE paper Table 1",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_h14_256e": {
        "description": "Soft MoE H/14, 256 experts in the last 16 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "H/14",
        "overrides": {"num_experts": 256},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 54_177_406_889,
            "paper_params": "54B",
            "accuracy": {"lit_in_0shot": 84.6},
            "source": "Soft MoE paper Table 3 and projects/soft_moe/configs",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_h14_128e": {
        "description": "Soft MoE H/14, 128 experts in the last 16 blocks, JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "H/14",
        "overrides": {"num_experts": 128},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 27_318_132_649,
            "paper_params": "27B",
            "accuracy": None,
            "source": "Soft MoE paper abstract ('Huge/14 with 128 experts in 16 MoE "
            "layers')",
            "notes": _SOFT_MOE_NOTE,
        },
    },
    "soft_moe_ti16_128e": {
        "description": (
            "Soft MoE Ti/16, 128 experts in the last 6 blocks, 224px; "
            "architecture only (Ti size of the upstream configs)."
        ),
        "family": "soft_moe",
        "variant": "Ti/16",
        "overrides": {"num_experts": 128},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 236_838_943,
            "accuracy": None,
            "source": "projects/soft_moe/configs/common.py (Ti variant)",
            "notes": "Not a model of the paper's tables; the smallest size of the "
            "upstream Soft MoE configs, handy for experiments. " + _SOFT_MOE_NOTE,
        },
    },
    # Soft MoE paper dense ViT baselines (Table 1).
    "soft_moe_dense_s16": {
        "description": "Dense ViT-S/16 baseline of the Soft MoE paper on JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "S/16",
        "overrides": {"layout": "none"},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 33_059_737,
            "paper_params": "33M",
            "accuracy": {"jft_p1": 51.3, "in_10shot": 67.6, "in_finetune": 84.0},
            "source": "Soft MoE paper Table 1",
            "notes": "The paper's ViT baseline (GAP, qk-norm, standard ViT sizes); no "
            "weights were released.",
        },
    },
    "soft_moe_dense_b16": {
        "description": "Dense ViT-B/16 baseline of the Soft MoE paper on JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "B/16",
        "overrides": {"layout": "none"},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 108_555_673,
            "paper_params": "108M",
            "accuracy": {"jft_p1": 56.2, "in_10shot": 76.8, "in_finetune": 86.6},
            "source": "Soft MoE paper Table 1",
            "notes": "The paper's ViT baseline (GAP, qk-norm, standard ViT sizes); no "
            "weights were released.",
        },
    },
    "soft_moe_dense_l16": {
        "description": "Dense ViT-L/16 baseline of the Soft MoE paper on JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "L/16",
        "overrides": {"layout": "none"},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 333_635_481,
            "paper_params": "333M",
            "accuracy": {"jft_p1": 59.8, "in_10shot": 81.5, "in_finetune": 88.5},
            "source": "Soft MoE paper Table 1",
            "notes": "The paper's ViT baseline (GAP, qk-norm, standard ViT sizes); no "
            "weights were released.",
        },
    },
    "soft_moe_dense_h14": {
        "description": "Dense ViT-H/14 baseline of the Soft MoE paper on JFT-4B, 224px; architecture only.",
        "family": "soft_moe",
        "variant": "H/14",
        "overrides": {"layout": "none"},
        "image_size": 224,
        "task": {
            "kind": "classifier",
            "num_classes": 29593,
            "head_bias_init": _BIAS_JFT4B,
        },
        "routing": {},
        "weights": None,
        "metadata": {
            "paper": SOFT_MOE_PAPER,
            "dataset": "JFT-4B",
            "params": 668_675_993,
            "paper_params": "669M",
            "accuracy": {"jft_p1": 59.7, "in_10shot": 83.3, "in_finetune": 88.9},
            "source": "Soft MoE paper Table 1",
            "notes": "The paper's ViT baseline (GAP, qk-norm, standard ViT sizes); no "
            "weights were released.",
        },
    },
    # ------------------------------------------------------------------
    # E³ paper architectures (K=1, M=2), no released weights.
    # ------------------------------------------------------------------
    "eee_s32_last2": {
        "description": "E³ S/32 Last-2 (E=32, K=1, M=2), ImageNet fine-tune at 384px; architecture only.",
        "family": "eee",
        "variant": "S/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 512,
        },
        "image_size": 384,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 157_858_792,
            "upstream_group_size": 2320,
            "paper_params": "166.7M (upstream JFT model)",
            "accuracy": {"in_error": 21.18, "in_nll": 0.818, "in_ece": 0.015},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE,
        },
    },
    "eee_b32_last2": {
        "description": "E³ B/32 Last-2 (E=32, K=1, M=2), ImageNet fine-tune at 384px; architecture only.",
        "family": "eee",
        "variant": "B/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 768,
        },
        "image_size": 384,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 381_727_720,
            "upstream_group_size": 2320,
            "paper_params": "395.0M (upstream JFT model)",
            "accuracy": {"in_error": 16.70, "in_nll": 0.622, "in_ece": 0.018},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE,
        },
    },
    "eee_b16_last2": {
        "description": "E³ B/16 Last-2 (E=32, K=1, M=2), ImageNet fine-tune at 384px; architecture only.",
        "family": "eee",
        "variant": "B/16",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 768,
        },
        "image_size": 384,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 380_290_024,
            "upstream_group_size": 9232,
            "paper_params": "393.3M (upstream JFT model)",
            "accuracy": {"in_error": 14.26, "in_nll": 0.519, "in_ece": 0.020},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE,
        },
    },
    "eee_l32_last2": {
        "description": "E³ L/32 Last-2 (E=32, K=1, M=2), ImageNet fine-tune at 384px; architecture only.",
        "family": "eee",
        "variant": "L/32",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 1024,
        },
        "image_size": 384,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 828_158_952,
            "upstream_group_size": 2320,
            "paper_params": "845.8M (upstream JFT model)",
            "accuracy": {"in_error": 14.70, "in_nll": 0.535, "in_ece": 0.027},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE,
        },
    },
    "eee_l16_last2": {
        "description": "E³ L/16 Last-2 (E=32, K=1, M=2), ImageNet fine-tune at 384px; architecture only.",
        "family": "eee",
        "variant": "L/16",
        "overrides": {
            "layout": "last2",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 1024,
        },
        "image_size": 384,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 826_242_024,
            "upstream_group_size": 9232,
            "paper_params": "843.6M (upstream JFT model)",
            "accuracy": {"in_error": 12.60, "in_nll": 0.448, "in_ece": 0.020},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE,
        },
    },
    "eee_h14_last5": {
        "description": "E³ H/14 Last-5 (E=32, K=1, M=2), ImageNet fine-tune at 384px (378px input); architecture only.",
        "family": "eee",
        "variant": "H/14",
        "overrides": {
            "layout": "last5",
            "num_experts": 32,
            "ensemble_size": 2,
            "representation_size": 1280,
        },
        "image_size": 378,
        "task": {
            "kind": "ensemble_classifier",
            "num_classes": 1000,
            "head_bias_init": -10.0,
        },
        "routing": {
            "num_selected_experts": 1,
            "capacity_factor": 8.0,
            "group_size": None,
            "batch_priority": False,
        },
        "weights": None,
        "metadata": {
            "paper": EEE_PAPER,
            "dataset": "ILSVRC2012",
            "params": 2_667_103_720,
            "upstream_group_size": 11680,
            "paper_params": "2688.6M (upstream JFT model)",
            "accuracy": {"in_error": 11.63, "in_nll": 0.408, "in_ece": 0.012},
            "source": "E³ paper Tables 20, 23 and 25",
            "notes": _EEE_NOTE + " Upstream feeds 384px images to the 14px patch "
            "embedding (VALID padding: the last 6 rows and columns are ignored, "
            "27x27 patches); here the input is 378px for the same 27x27 grid.",
        },
    },
    # ------------------------------------------------------------------
    # Dense ViT checkpoints of google-research/vision_transformer.
    # ------------------------------------------------------------------
    "vit_b16_imagenet21k": {
        "description": "ViT-B/16 pre-trained on ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "B/16",
        "overrides": {"representation_size": 768},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k/ViT-B_16.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ImageNet-21k",
            "params": 103_186_515,
            "accuracy": None,
            "source": "google-research/vision_transformer README",
            "notes": "Original ImageNet-21k checkpoints carry a pre-logits layer of size D (assumed from vit_jax). Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_b32_imagenet21k": {
        "description": "ViT-B/32 pre-trained on ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "B/32",
        "overrides": {"representation_size": 768},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k/ViT-B_32.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ImageNet-21k",
            "params": 104_843_091,
            "accuracy": None,
            "source": "google-research/vision_transformer README",
            "notes": "Original ImageNet-21k checkpoints carry a pre-logits layer of size D (assumed from vit_jax). Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_l16_imagenet21k": {
        "description": "ViT-L/16 pre-trained on ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "L/16",
        "overrides": {"representation_size": 1024},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k/ViT-L_16.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ImageNet-21k",
            "params": 326_740_307,
            "accuracy": None,
            "source": "google-research/vision_transformer README",
            "notes": "Original ImageNet-21k checkpoints carry a pre-logits layer of size D (assumed from vit_jax). Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_l32_imagenet21k": {
        "description": "ViT-L/32 pre-trained on ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "L/32",
        "overrides": {"representation_size": 1024},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k/ViT-L_32.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ImageNet-21k",
            "params": 328_949_075,
            "accuracy": None,
            "source": "google-research/vision_transformer README",
            "notes": "Original ImageNet-21k checkpoints carry a pre-logits layer of size D (assumed from vit_jax). Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_h14_imagenet21k": {
        "description": "ViT-H/14 pre-trained on ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "H/14",
        "overrides": {"representation_size": 1280},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k/ViT-H_14.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ImageNet-21k",
            "params": 660_385_363,
            "accuracy": None,
            "source": "google-research/vision_transformer README",
            "notes": "Original ImageNet-21k checkpoints carry a pre-logits layer of size D (assumed from vit_jax). Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_b16_imagenet21k_ft_imagenet2012": {
        "description": "ViT-B/16 ImageNet-21k, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "B/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-B_16.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 86_859_496,
            "accuracy": {"in_top1": 84.62},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_b32_imagenet21k_ft_imagenet2012": {
        "description": "ViT-B/32 ImageNet-21k, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "B/32",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-B_32.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 88_297_192,
            "accuracy": {"in_top1": 81.79},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_l16_imagenet21k_ft_imagenet2012": {
        "description": "ViT-L/16 ImageNet-21k, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "L/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-L_16.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 304_715_752,
            "accuracy": {"in_top1": 85.07},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_l32_imagenet21k_ft_imagenet2012": {
        "description": "ViT-L/32 ImageNet-21k, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "L/32",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-L_32.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 306_632_680,
            "accuracy": {"in_top1": 81.78},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_b16_imagenet21k_ft_imagenet2012_224": {
        "description": "ViT-B/16 ImageNet-21k, fine-tuned on ImageNet-1k at 224px.",
        "family": "vit",
        "variant": "B/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-B_16-224.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 86_567_656,
            "accuracy": {"in_top1": 81.2},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_l16_imagenet21k_ft_imagenet2012_224": {
        "description": "ViT-L/16 ImageNet-21k, fine-tuned on ImageNet-1k at 224px.",
        "family": "vit",
        "variant": "L/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/imagenet21k+imagenet2012/ViT-L_16-224.npz",
        },
        "metadata": {
            "paper": VIT_PAPER,
            "dataset": "ILSVRC2012",
            "params": 304_326_632,
            "accuracy": {"in_top1": 82.7},
            "source": "google-research/vision_transformer README",
        },
    },
    "vit_ti16_augreg_imagenet21k": {
        "description": "ViT-Ti/16 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "Ti/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 9_740_115,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_s32_augreg_imagenet21k": {
        "description": "ViT-S/32 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "S/32",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 30_903_507,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_s16_augreg_imagenet21k": {
        "description": "ViT-S/16 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "S/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 30_075_219,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_b32_augreg_imagenet21k": {
        "description": "ViT-B/32 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "B/32",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 104_252_499,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_b16_augreg_imagenet21k": {
        "description": "ViT-B/16 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "B/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 102_595_923,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_l16_augreg_imagenet21k": {
        "description": "ViT-L/16 AugReg, ImageNet-21k, 224px.",
        "family": "vit",
        "variant": "L/16",
        "overrides": {"representation_size": None},
        "image_size": 224,
        "task": {"kind": "classifier", "num_classes": 21843, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ImageNet-21k",
            "params": 325_690_707,
            "accuracy": None,
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
            "notes": "Pre-training head (21,843 classes); pass num_classes=... to fine-tune.",
        },
    },
    "vit_ti16_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-Ti/16 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "Ti/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 5_790_376,
            "accuracy": {"in_top1": 78.22},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
    "vit_s32_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-S/32 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "S/32",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 22_915_432,
            "accuracy": {"in_top1": 79.58},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
    "vit_s16_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-S/16 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "S/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 22_196_584,
            "accuracy": {"in_top1": 83.73},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
    "vit_b32_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-B/32 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "B/32",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 88_297_192,
            "accuracy": {"in_top1": 83.59},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
    "vit_b16_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-B/16 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "B/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.03-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 86_859_496,
            "accuracy": {"in_top1": 85.49},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
    "vit_l16_augreg_imagenet21k_ft_imagenet2012": {
        "description": "ViT-L/16 AugReg, fine-tuned on ImageNet-1k at 384px.",
        "family": "vit",
        "variant": "L/16",
        "overrides": {"representation_size": None},
        "image_size": 384,
        "task": {"kind": "classifier", "num_classes": 1000, "head_bias_init": 0.0},
        "routing": {},
        "weights": {
            "format": "vit_npz",
            "upstream": f"{VIT_BUCKET}/augreg/L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0--imagenet2012-steps_20k-lr_0.01-res_384.npz",
        },
        "metadata": {
            "paper": AUGREG_PAPER,
            "dataset": "ILSVRC2012",
            "params": 304_715_752,
            "accuracy": {"in_top1": 85.59},
            "source": "google-research/vision_transformer README (AugReg recommended checkpoints)",
        },
    },
}

# Short names. V-MoE and E³ default to the paper's main layout (Last-2 for
# S/B/L, Last-5 for H); Soft MoE to the expert count of the paper's long
# runs; dense `vit_*` names to the AugReg ImageNet-21k checkpoints (the
# usual starting point for fine-tuning; the original ViT paper ones for L/32
# and H/14, which AugReg did not release).
ALIASES = {
    "vmoe_s32": "vmoe_s32_last2",
    "vmoe_b32": "vmoe_b32_last2",
    "vmoe_b16": "vmoe_b16_last2",
    "vmoe_l32": "vmoe_l32_last2",
    "vmoe_l16": "vmoe_l16_last2",
    "vmoe_h14": "vmoe_h14_last5",
    "vmoe_15b_every2": "vmoe_15b",
    "soft_moe_ti16": "soft_moe_ti16_128e",
    "soft_moe_s16": "soft_moe_s16_128e",
    "soft_moe_s14": "soft_moe_s14_256e",
    "soft_moe_b16": "soft_moe_b16_128e",
    "soft_moe_l16": "soft_moe_l16_128e",
    "soft_moe_h14": "soft_moe_h14_256e",
    "eee_s32": "eee_s32_last2",
    "eee_b32": "eee_b32_last2",
    "eee_b16": "eee_b16_last2",
    "eee_l32": "eee_l32_last2",
    "eee_l16": "eee_l16_last2",
    "eee_h14": "eee_h14_last5",
    "vit_ti16": "vit_ti16_augreg_imagenet21k",
    "vit_s16": "vit_s16_augreg_imagenet21k",
    "vit_s32": "vit_s32_augreg_imagenet21k",
    "vit_b16": "vit_b16_augreg_imagenet21k",
    "vit_b32": "vit_b32_augreg_imagenet21k",
    "vit_l16": "vit_l16_augreg_imagenet21k",
    "vit_l32": "vit_l32_imagenet21k",
    "vit_h14": "vit_h14_imagenet21k",
}
