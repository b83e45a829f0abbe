"""keras-vmoe predict: classify image files (JPEG/PNG/...) with a preset.

PATH is an image file or a folder (searched recursively). Prints the top-k
classes of every image: the class names saved with a fine-tuned preset,
ImageNet-1k names for the released ILSVRC presets, else class ids. Images
of any size are converted by the model's image converter.
"""

import os

from keras_vmoe import presets
from keras_vmoe.catalog import PRESETS
from keras_vmoe.catalog import names
from keras_vmoe.cli import CliError
from keras_vmoe.cli import emit_json
from keras_vmoe.cli import progress
from keras_vmoe.cli.arguments import positive_int as _positive_int
from keras_vmoe.cli.finetune import DEFAULT_OUTPUT
from keras_vmoe.data.images import IMAGE_EXTENSIONS
from keras_vmoe.data.images import UnreadableImageError
from keras_vmoe.data.images import read_image
from keras_vmoe.data.images import warn_skipped
from keras_vmoe.data.labels import imagenet_class_names
from keras_vmoe.utils import safe_files

DEFAULT_PRESET = os.path.join(DEFAULT_OUTPUT, "preset")


def add_arguments(parser):
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="image files or folders of images")
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help="preset name or directory (default: the output of "
                        f"`keras-vmoe finetune`, ./{DEFAULT_PRESET})")
    parser.add_argument("--top-k", type=_positive_int, default=5)
    parser.add_argument("--batch-size", type=_positive_int, default=32)
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")


def find_images(paths):
    """Image files under `paths` (files kept as given; folders walked, sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = []
            for root, dirs, names in os.walk(path):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names)
                          if n.lower().endswith(IMAGE_EXTENSIONS)]
            if not found:
                raise FileNotFoundError(
                    f"No image files ({', '.join(IMAGE_EXTENSIONS)}) under {path!r}.")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"No such image file or folder: {path!r}")
    return files


def printable(text):
    """`text` with control characters (terminal escapes, newlines) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def preset_class_names(preset, num_classes):
    """Class names for a preset: saved names, ImageNet-1k, or None."""
    if os.path.isdir(preset):
        meta = os.path.join(preset, "metadata.json")
        if os.path.exists(meta):
            names = safe_files.read_json_file(meta, "preset metadata file").get(
                "class_names")
            if names and len(names) == num_classes:
                return [str(n) for n in names]
    return imagenet_class_names() if num_classes == 1000 else None


def check_preset(preset):
    """Refuses unknown names and architecture-only presets before loading anything."""
    if os.path.isdir(preset):
        return
    canonical = names.resolve_preset_name(preset)
    if canonical is None:
        if preset == DEFAULT_PRESET:
            raise CliError(f"No preset at {preset!r}. Run `keras-vmoe finetune` "
                           "first, or pass --preset.")
        close = names.suggest_preset_names(preset)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise CliError(f"Unknown preset {preset!r}.{hint} See `keras-vmoe presets` "
                       "(`keras-vmoe presets --with-weights` for those that classify).")
    if names.weights_location(canonical) == "none":
        entry = PRESETS[canonical]
        dataset = entry.get("metadata", {}).get("dataset") or "its pre-training data"
        raise CliError(
            f"{preset!r} is architecture only: no checkpoint of it was released, so "
            "its weights would be random and its predictions meaningless (its "
            f"{entry['task']['num_classes']:,} outputs are the classes of {dataset}). "
            "Presets with weights: `keras-vmoe presets --with-weights`.")


def run(args):
    files = find_images(args.paths)
    check_preset(args.preset)  # before Keras and JAX load
    import keras
    import numpy as np

    progress(f"loading {args.preset}")
    model = presets.from_preset(args.preset)
    num_classes = getattr(model, "num_classes", None)
    if not num_classes:
        raise CliError(f"{args.preset!r} has no classification head.")
    names = preset_class_names(args.preset, num_classes)
    if names is None:
        progress(f"no class names known for {args.preset}'s {num_classes:,} classes: "
                 "class ids are shown")
    top_k = min(args.top_k, num_classes)
    progress(f"classifying {len(files)} image(s)")

    results = []
    skipped = 0
    first_call = True
    for start in range(0, len(files), args.batch_size):
        # Unreadable files are skipped with a warning; the model converts the rest.
        batch_files, images = [], []
        for f in files[start:start + args.batch_size]:
            try:
                images.append(read_image(f))
            except UnreadableImageError as error:
                warn_skipped(error.path, error.reason)
                skipped += 1
                continue
            batch_files.append(f)
        if not batch_files:
            continue
        if first_call and keras.backend.backend() in ("jax", "tensorflow"):
            # JAX and TensorFlow compile for the first batch shape (can take minutes).
            progress("compiling the model (first call)")
        first_call = False
        probs = model.predict_probabilities(images, batch_size=args.batch_size,
                                            verbose=0)
        for path, p in zip(batch_files, probs, strict=True):
            order = np.argsort(-p)[:top_k]
            results.append({"path": path, "top_k": [
                {"class_id": int(i), "class_name": names[i] if names else str(int(i)),
                 "probability": float(p[i])} for i in order]})
    if not results:
        raise CliError(f"None of the {len(files)} image file(s) could be read "
                       "(see the warnings above).")
    if args.json:
        emit_json({"preset": args.preset, "predictions": results,
                   "skipped": skipped})
    else:
        for r in results:
            best = ", ".join(f"{printable(c['class_name'])} ({c['probability']:.3f})"
                             for c in r["top_k"])
            print(f"{printable(r['path'])}: {best}")
    return 0
