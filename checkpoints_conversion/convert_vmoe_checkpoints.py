#!/usr/bin/env python
"""Converts a google-research/vmoe (or vision_transformer .npz) checkpoint
into a keras_vmoe preset directory.

Examples:

```
# A released checkpoint; routing settings from the preset catalog.
python checkpoints_conversion/convert_vmoe_checkpoints.py \\
    --upstream gs://vmoe_checkpoints/vmoe_s32_last2_ilsvrc2012_randaug_light1 \\
    --preset vmoe_s32_last2_ilsvrc2012_randaug_light1 --output ./vmoe_s32_light1

# Explicit routing, checked against reference outputs.
python checkpoints_conversion/convert_vmoe_checkpoints.py \\
    --upstream /ckpts/my_vmoe --num-selected-experts 2 --capacity-factor 1.05 \\
    --group-size 400 --router token_choice --output ./my_vmoe \\
    --validate-inputs images.npy --validate-logits logits.npy --atol 1e-3
```

Same as `keras-vmoe convert ...`; see `keras_vmoe.cli.convert_cmd`.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_vmoe.cli.convert_cmd import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="convert_vmoe_checkpoints.py"))
