"""Released upstream checkpoints of built-in presets: fetch and convert once.

The files come from a local mirror (`$KERAS_VMOE_CHECKPOINT_ROOT`), an
HTTP(S) mirror named by that variable, or the public bucket; downloads
resume, are converted with `keras_vmoe.presets.convert` and the result is
cached in `<keras home>/keras_vmoe/<name>/`. No TensorFlow is needed.
"""

import contextlib
import os
import shutil
import sys

from keras_vmoe.catalog.names import CHECKPOINT_ROOT_ENV
from keras_vmoe.catalog.names import CONFIG_FILE
from keras_vmoe.catalog.names import bucket_relative as _bucket_relative
from keras_vmoe.catalog.names import is_preset_dir as _is_preset_dir
from keras_vmoe.catalog.names import mirror_source as _mirror_source
from keras_vmoe.catalog.names import preset_cache_dir
from keras_vmoe.formats import partitioned
from keras_vmoe.formats import remote
from keras_vmoe.formats.partitioned import CheckpointError
from keras_vmoe.presets import integrity


class PresetWeightsUnavailableError(FileNotFoundError):
    """The weights of a built-in preset cannot be found or fetched.

    The message ends with `RANDOM_WEIGHTS_HINT` (the command line puts its
    own flag there).
    """

    RANDOM_WEIGHTS_HINT = ("Pass load_weights=False to build the architecture "
                           "with random weights.")


# Converter (in `keras_vmoe.presets.convert`) per upstream weight format,
# called as `function(source, output_dir, preset_name=name)`.
CONVERTERS = {
    "vmoe_partitioned": "convert_to_preset",
    "vit_npz": "convert_vit_npz_to_preset",
}


def _weights_help(name, entry, reasons, url=None):
    weights = entry["weights"]
    upstream = weights["upstream"]
    if weights["format"] == "vmoe_partitioned":
        files = f"{upstream}.index and {upstream}.data-*"
        copy_cmd = f"gsutil -m cp '{upstream}.*' /path/to/mirror/"
    else:
        files = upstream
        copy_cmd = f"gsutil cp '{upstream}' /path/to/mirror/"
    _, relative = _bucket_relative(upstream)
    lines = [
        f"The pretrained weights of preset {name!r} are not available here.",
        f"They come from the upstream checkpoint {upstream} ({files}"
        + (f", downloaded from {remote.redact(url)}" if url else "")
        + "), which must be converted to a Keras preset once.",
        *[f"  - {reason}" for reason in reasons],
        "To get the weights, either:",
        f"  1. download the checkpoint (e.g. `{copy_cmd}`, keeping the bucket's "
        f"relative path {relative!r}) and set {CHECKPOINT_ROOT_ENV}=/path/to/mirror, "
        f"or set {CHECKPOINT_ROOT_ENV}=https://host/path to download from an HTTP(S) "
        "mirror in the bucket's layout (<base>/<bucket>/<object>); from_preset then "
        f"converts it and caches the result in {preset_cache_dir(name)};",
        f"  2. or convert it yourself: `keras-vmoe convert --upstream {upstream} "
        f"--preset {name} --output DIR` and load it with from_preset(DIR);",
        "  3. or load a converted copy uploaded to a hub: "
        "from_preset('hf://owner/repo') or from_preset('kaggle://owner/model/keras/variant').",
        PresetWeightsUnavailableError.RANDOM_WEIGHTS_HINT,
    ]
    return "\n".join(lines)


def _download_base(root):
    """The HTTP(S) base of downloads: `root` if it is a URL, else the public bucket."""
    return root.rstrip("/") if remote.is_http(root or "") else remote.GCS_BASE


def _shows_progress(verbose):
    return bool(verbose if verbose != "auto" else sys.stdout.isatty())


class _ByteProgress:
    """A `keras.utils.Progbar` of bytes (size, rate, time left), or nothing."""

    def __init__(self, total, label, verbose):
        self.done = 0
        self.bar = None
        if _shows_progress(verbose) and total:
            import keras

            print(f"Downloading {label} ({total / 1e6:.1f} MB)", flush=True)
            self.bar = keras.utils.Progbar(total, unit_name="B",
                                           stateful_metrics=["MB/s"])
            self.start = None

    def __call__(self, count):
        import time

        if self.bar is None:
            self.done += count
            return
        if self.start is None:
            self.start = (time.monotonic(), self.done)
        self.done += count
        elapsed = time.monotonic() - self.start[0]
        rate = (self.done - self.start[1]) / elapsed / 1e6 if elapsed > 0 else 0.0
        self.bar.update(self.done, values=[("MB/s", rate)])


def _download_released(weights, base, target, verbose="auto"):
    """Downloads a released checkpoint under `target`; returns the local source."""
    upstream = weights["upstream"]
    url = remote.public_url(upstream, base)
    bucket, relative = _bucket_relative(upstream)
    local = os.path.join(target, bucket, *relative.split("/"))
    if weights["format"] != "vmoe_partitioned":
        stat = remote.remote_stat(url)
        _download(url, local, stat, _ByteProgress(stat.size, upstream, verbose))
        return local
    index_stat = remote.remote_stat(url + ".index")
    index_file = _download(url + ".index", local + ".index", index_stat)
    try:
        index = partitioned.read_index(local)
    except partitioned.CheckpointError:
        os.remove(index_file)  # a corrupt download is not kept
        raise
    # Only the data files the leaves use, whatever shard_count says.
    shards = [partitioned.shard_path("", s, index.shard_count)
              for s in index.used_shards]
    stats = [remote.remote_stat(url + shard) for shard in shards]
    progress = _ByteProgress(index_stat.size + sum(s.size for s in stats), upstream,
                             verbose)
    progress(index_stat.size)
    for shard, stat in zip(shards, stats, strict=True):
        _download(url + shard, local + shard, stat, progress)
    return local


def _download(url, local, stat, progress=None):
    """`remote.download` of a file whose `remote.remote_stat` is `stat`."""
    return remote.download(url, local, size=stat.size, md5=stat.md5,
                           version=stat.version, progress=progress)


def _remove_download(source, weights, downloads):
    """Deletes the downloaded files of `source`, and the folders left empty."""
    suffixes = (".index", ".data-") if weights["format"] == "vmoe_partitioned" else ("",)
    directory, name = os.path.split(source)
    for entry in os.listdir(directory):
        if any(entry == name + s or (s == ".data-" and entry.startswith(name + s))
               for s in suffixes):
            os.remove(os.path.join(directory, entry))
    while os.path.abspath(directory) != os.path.dirname(os.path.abspath(downloads)):
        with contextlib.suppress(OSError):
            os.rmdir(directory)
        directory = os.path.dirname(directory)


def _mirror_or_reasons(weights, cache_dir, corrupt):
    """`(local mirror source or None, root, reasons the weights are not here)`."""
    reasons = [f"the cached conversion {cache_dir} is corrupt: {corrupt}" if corrupt
               else f"no converted preset in the cache ({cache_dir})"]
    source = None
    root = os.environ.get(CHECKPOINT_ROOT_ENV)
    if root and not remote.is_http(root):
        source = _mirror_source(weights, os.path.expanduser(root))
        if source is None:
            _, relative = _bucket_relative(weights["upstream"])
            suffix = ".index" if weights["format"] == "vmoe_partitioned" else ""
            expected = os.path.join(os.path.expanduser(root), relative + suffix)
            reasons.append(f"{CHECKPOINT_ROOT_ENV}={root!r} does not hold the "
                           f"checkpoint (expected {expected})")
    elif not root:
        reasons.append(f"{CHECKPOINT_ROOT_ENV} (a mirror of the bucket) is not set")
    return source, root, reasons


def _unavailable(name, entry, reasons, url, error):
    """The `PresetWeightsUnavailableError` of a failed download (raise `from None`)."""
    reasons.append(f"no connection to the server ({error})"
                   if isinstance(error, remote.RemoteUnreachableError)
                   else f"the download failed: {error}")
    return PresetWeightsUnavailableError(_weights_help(name, entry, reasons, url))


def check_released_weights(name, entry):
    """Raises `PresetWeightsUnavailableError` unless the weights of the built-in
    preset `name` are cached, mirrored or on the server (no download, no Keras)."""
    weights = entry["weights"]
    cache_dir = preset_cache_dir(name)
    if weights is None or _is_preset_dir(cache_dir):
        return
    source, root, reasons = _mirror_or_reasons(weights, cache_dir, None)
    if source is not None:
        return
    url = remote.public_url(weights["upstream"], _download_base(root))
    suffix = ".index" if weights["format"] == "vmoe_partitioned" else ""
    try:
        remote.remote_info(url + suffix)
    except remote.RemoteError as error:
        raise _unavailable(name, entry, reasons, url, error) from None


def _fetch_released(name, entry, cache_dir, corrupt=None, verbose="auto"):
    """Converts a released checkpoint into `cache_dir`, replacing a `corrupt` one."""
    weights = entry["weights"]
    source, root, reasons = _mirror_or_reasons(weights, cache_dir, corrupt)
    downloaded = source is None
    if downloaded:
        base = _download_base(root)
        url = remote.public_url(weights["upstream"], base)
        downloads = os.path.join(os.path.dirname(cache_dir), ".downloads")
        try:
            source = _download_released(weights, base, downloads, verbose)
        except remote.RemoteError as error:
            raise _unavailable(name, entry, reasons, url, error) from None
    from keras_vmoe.presets import (
        convert as preset_convert,  # lazy: the weights check runs without Keras
    )

    convert = getattr(preset_convert, CONVERTERS[weights["format"]])
    if _shows_progress(verbose):
        print(f"Converting {weights['upstream']} to the preset {name!r} "
              f"(cached in {cache_dir})", flush=True)
    tmp_root = integrity.new_temp_dir(cache_dir)
    try:
        output = os.path.join(tmp_root, "preset")
        try:
            convert(source, output, preset_name=name)
        except CheckpointError:
            # Downloaded files that cannot be read are not reused by a rerun.
            if downloaded:
                _remove_download(source, weights, downloads)
            raise
        if not _is_preset_dir(output):
            raise RuntimeError(
                f"The converter for {weights['format']!r} wrote no preset "
                f"({CONFIG_FILE} missing) in {output!r}.")
        if corrupt:
            integrity.replace_dir(output, cache_dir)
        else:
            try:
                os.rename(output, cache_dir)
            except OSError:
                if not _is_preset_dir(cache_dir):  # not a concurrent conversion
                    raise
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    if downloaded:
        _remove_download(source, weights, downloads)
    return cache_dir
