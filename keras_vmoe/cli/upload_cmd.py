"""keras-vmoe upload: a converted preset -> Hugging Face or Kaggle Models.

Examples:
  keras-vmoe upload hf://me/vmoe-s32-light1 ./vmoe_s32_light1
  keras-vmoe upload kaggle://me/vmoe/keras/s32-light1 ./vmoe_s32_light1

The preset's files are checked against their SHA-256 in metadata.json, then
uploaded (needs `pip install 'keras-vmoe[hub]'` and a login to the hub).
"""

import sys

from keras_vmoe.presets.upload import upload_preset


def add_arguments(parser):
    parser.add_argument("uri", help="hf://owner/repo[/subdir] or "
                                    "kaggle://owner/model/keras/variant")
    parser.add_argument("preset", help="local preset directory")


def run(args) -> int:
    try:
        upload_preset(args.uri, args.preset)
    except ImportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Uploaded {args.preset} to {args.uri}")
    return 0
