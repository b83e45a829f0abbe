"""Markdown performance tables from the benchmarks' JSON, and the README section.

Give one or more JSON files of ``benchmarks/moe_layer.py`` (``--layer``) and
optionally of ``benchmarks/models.py`` (``--models``). Several runs of the
same benchmark give the spread across runs: every cell shows the median
over runs and, when there are several, their min-max range.

Run from the repository root::

    python benchmarks/moe_layer.py --output layer1.json   # twice or more
    python benchmarks/moe_layer.py --output layer2.json
    python benchmarks/models.py --output models.json
    python benchmarks/report.py --layer layer1.json layer2.json \\
        --models models.json --write-readme README.md

``--write-readme`` replaces only the text between the ``<!-- benchmarks:start
-->`` and ``<!-- benchmarks:end -->`` markers (written atomically); without
it the tables go to stdout.
"""

import argparse
import json
import os
import statistics

START_MARKER = "<!-- benchmarks:start -->"
VARIANT_NAMES = {
    "dense": "dense MLP",
    "index": "index (default)",
    "index_alt": "index, other experts path",
    "einsum": "one-hot einsum reference",
}
END_MARKER = "<!-- benchmarks:end -->"


def load(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def cell(values, fmt="{:.2f}", suffix="×"):
    """Median over runs, with the min-max range when there are several."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    text = fmt.format(statistics.median(values)) + suffix
    if len(values) > 1:
        text += f" ({fmt.format(min(values))}–{fmt.format(max(values))})"
    return text


def provenance(runs, label):
    envs = [r["environment"] for r in runs]
    dates = sorted({e["date_utc"][:10] for e in envs})
    commits = list(dict.fromkeys((e.get("git_commit") or "unknown")[:8] for e in envs))
    first = envs[0]
    return (
        f"{label}: {len(runs)} run(s) on {', '.join(dates)}, device "
        f"`{first['device_kind']}` ({first['cpu_count']} CPUs), jax "
        f"{first['jax_version']}, keras {first['keras_version']}, "
        f"{'commit' if len(commits) == 1 else 'commits'} "
        f"{', '.join(f'`{c}`' for c in commits)}, "
        f"{runs[0]['settings']['reps']} repetitions per run"
        + (
            f" of {runs[0]['settings']['calls_per_sample']} back-to-back calls"
            if runs[0]["settings"].get("calls_per_sample", 1) > 1
            else ""
        )
        + "."
        + (
            f" CPU: {first['cpu_model']} (family/model {first['cpu_family_model']}, "
            f"{first['cpu_vector_isa']})."
            if first.get("cpu_model")
            else ""
        )
    )


# Labels of the index rows when the run recorded each mode's expert path.
PATH_LABELS = {
    "index": "index (default; experts: {} fwd / {} fwd+bwd)",
    "index_alt": "index, other experts path ({} fwd / {} fwd+bwd)",
}


def variant_label(shape, variant):
    """Row label; the index rows name the expert path each mode ran."""
    paths = [shape[mode][variant].get("experts_implementation") for mode in ("fwd", "fwd_bwd")]
    if variant in PATH_LABELS and None not in paths:
        return PATH_LABELS[variant].format(*paths)
    return VARIANT_NAMES[variant]


def layer_table(runs):
    # The small-row floor is a CPU notion: on an accelerator the cache-resident
    # probe measures launch latency (older GPU JSON still carries a value).
    on_cpu = runs[0]["environment"].get("platform", "cpu") == "cpu"
    lines = [
        "| shape | path | fwd vs dense | fwd vs floor | fwd+bwd vs dense "
        "| fwd+bwd vs floor | vs small-row floor fwd / fwd+bwd "
        "| vs bare expert matmuls fwd / fwd+bwd | floor bound (fwd) "
        "| temp memory fwd / fwd+bwd vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, shape in enumerate(runs[0]["shapes"]):
        c = shape["config"]
        label = (
            f"S={c['group_size_S']}, D={c['hidden_D']}, M={c['expert_mlp_M']}, "
            f"E={c['num_experts_E']}, K={c['num_selected_experts_K']}, "
            f"C={c['capacity_C']}"
            + (f", {c['num_groups_G']} groups" if c.get("num_groups_G", 1) > 1 else "")
        )
        for variant in VARIANT_NAMES:
            if variant not in shape["fwd"]:
                continue  # older JSON without this variant

            def values(mode, key, variant=variant, index=index):
                return [r["shapes"][index][mode][variant].get(key) for r in runs]

            fwd = shape["fwd"][variant]

            def pair(key, values=values):
                """`fwd / fwd+bwd` cells; the fwd+bwd key ends in `_fwd_bwd`."""
                fwd_key = key.replace("{mode}", "fwd")
                bwd_key = key.replace("{mode}", "fwd_bwd")
                return (f"{cell(values('fwd', fwd_key))} / "
                        f"{cell(values('fwd_bwd', bwd_key))}")

            small_row = (pair('time_ratio_vs_small_row_floor')
                         if variant != 'dense' and on_cpu else '–')
            lines.append(
                f"| {label if variant == 'dense' else ''} | {variant_label(shape, variant)} "
                f"| {cell(values('fwd', 'time_ratio_vs_dense'))} "
                f"| {cell(values('fwd', 'time_ratio_vs_floor'))} "
                f"| {cell(values('fwd_bwd', 'time_ratio_vs_dense'))} "
                f"| {cell(values('fwd_bwd', 'time_ratio_vs_floor'))} "
                f"| {small_row} "
                f"| {pair('time_ratio_vs_expert_matmuls_{mode}') if variant != 'dense' else '–'} "
                f"| {fwd['floor_bound']} ({fwd['floor_ms']:.3g} ms) "
                f"| {fwd['temp_ratio_vs_dense']:.2f}× / "
                f"{shape['fwd_bwd'][variant]['temp_ratio_vs_dense']:.2f}× |"
            )
    machine = [r["shapes"][0]["machine"] for r in runs]
    lines.append("")
    lines.append(
        "Measured floor inputs (best probe of each run, first shape): matmul "
        f"{cell([m['matmul_gflops'] for m in machine], '{:.0f}', ' GFLOP/s')}, "
        "streaming read "
        f"{cell([m['stream_read_gbytes_per_s'] for m in machine], '{:.1f}', ' GB/s')}. "
        "Bare expert matmuls (the two batched matmuls alone at each shape's "
        "per-expert row count, best call): "
        + ", ".join(
            f"E={shape['config']['num_experts_E']} "
            + probe_cell(runs, i, "expert_matmuls_fwd")
            + numpy_note(runs, i)
            for i, shape in enumerate(runs[0]["shapes"])
        )
        + "."
    )
    if on_cpu and all("expert_matmuls_fwd_resident" in m for m in machine):
        lines.append("")
        lines.append(
            "Small-row kernels (the same matmuls with the weights resident in "
            "cache, fwd / fwd+bwd; the small-row floor takes the FLOPs at "
            "this rate): "
            + ", ".join(
                f"E={shape['config']['num_experts_E']} "
                + probe_cell(runs, i, "expert_matmuls_fwd_resident") + " / "
                + probe_cell(runs, i, "expert_matmuls_fwd_bwd_resident")
                for i, shape in enumerate(runs[0]["shapes"])
            )
            + "."
        )
    return "\n".join(lines)


def probe_cell(runs, index, name):
    """GFLOP/s of one expert-matmul probe across runs."""
    return cell([r["shapes"][index]["machine"][name]["gflops"] for r in runs],
                "{:.0f}", " GFLOP/s")


def numpy_note(runs, index):
    """The same matmuls through NumPy's BLAS, when the runs measured them."""
    probes = [r["shapes"][index]["machine"].get("expert_matmuls_fwd_numpy") for r in runs]
    if not all(probes):
        return ""
    blas = probes[0].get("blas") or "BLAS"
    return f" (NumPy/{blas}: {cell([p['gflops'] for p in probes], '{:.0f}', ' GFLOP/s')})"


def models_table(runs):
    lines = [
        "| model | baseline | batch | latency (ms) | images/s | time vs baseline "
        "| bare-matmul floor vs baseline | time vs floor "
        "| temp memory vs baseline | tokens dropped |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = runs[0]
    has_floor = False
    for batch, per_model in first["inference"].items():
        for name, result in per_model.items():
            for base in result.get("vs", {}):
                def values(key, name=name, batch=batch):
                    return [r["inference"][batch][name][key] for r in runs]

                def versus(key, name=name, batch=batch, base=base):
                    # Runs made before the floor existed lack its keys.
                    return [r["inference"][batch][name]["vs"][base].get(key) for r in runs]

                temp = result["vs"][base]["temp_ratio"]
                dropped = result["tokens_dropped_fraction"]
                has_floor = has_floor or any(versus("bare_matmul_floor_ratio"))
                lines.append(
                    f"| {name} | {base} | {batch} "
                    f"| {cell(values('median_ms'), '{:.1f}', '')} "
                    f"| {cell(values('images_per_s'), '{:.1f}', '')} "
                    f"| {cell(versus('time_ratio'))} "
                    f"| {cell(versus('bare_matmul_floor_ratio'))} "
                    f"| {cell(versus('time_ratio_vs_bare_matmul_floor'))} "
                    f"| {'–' if temp is None else f'{temp:.2f}×'} "
                    f"| {'–' if dropped is None else f'{100 * dropped:.1f}%'} |"
                )
    if has_floor:
        lines += [
            "",
            "Bare-matmul floor: the baseline's time, minus the dense MLPs the MoE "
            "blocks replace, plus those blocks' experts run as bare batched "
            "matmuls at their real row counts (routing, dispatch and combine "
            "free), all timed in the same process.",
        ]
    train_runs = [r for r in runs if "train" in r]  # some runs skip training
    if train_runs:
        lines += [
            "",
            f"Training: {len(train_runs)} of the {len(runs)} run(s).",
            "",
            "| model | train batch | fit images/s | raw jitted step images/s "
            "| fit / raw time | fit time vs baseline |",
            "|---|---|---|---|---|---|",
        ]
        for name, result in train_runs[0]["train"].items():
            def tvalues(key, name=name):
                return [r["train"][name][key] for r in train_runs]

            vs = ", ".join(
                f"{cell([r['train'][name]['vs'][b]['fit_time_ratio'] for r in train_runs])} {b}"
                for b in result.get("vs", {})
            )
            lines.append(
                f"| {name} | {result['batch']} "
                f"| {cell(tvalues('fit_images_per_s'), '{:.2f}', '')} "
                f"| {cell(tvalues('raw_images_per_s'), '{:.2f}', '')} "
                f"| {cell(tvalues('fit_overhead_ratio'))} | {vs or '–'} |"
            )
    return "\n".join(lines)


SOFT_MOE_LABELS = {"bare_experts": "bare experts (the floor: two batched matmuls, GELU)"}


def soft_moe_table(runs):
    c = runs[0]["config"]
    lines = [
        f"Soft MoE layer B={c['batch_B']}, T={c['tokens_T']}, D={c['hidden_D']}, "
        f"M={c['expert_mlp_M']}, E={c['num_experts_E']}, P={c['slots_P']} "
        "(bfloat16 dispatch); outputs equal to the reference order of operations "
        "in every run: "
        f"{'yes' if all(r['outputs_match_reference_order'] for r in runs) else 'NO'}.",
        "",
        "| path | fwd (ms) | fwd vs reference order | fwd+bwd (ms) "
        "| fwd+bwd vs reference order | vs bare experts fwd / fwd+bwd |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs[0]["fwd"]:
        def values(mode, key, name=name):
            # Runs made before `bare_experts` existed lack its ratios.
            return [r[mode][name].get(key) for r in runs]

        label = SOFT_MOE_LABELS.get(name, name)
        if name == "default":
            label = f"default (experts: {runs[0]['default_experts_implementation']})"
        lines.append(
            f"| {label} | {cell(values('fwd', 'median_ms'), '{:.1f}', '')} "
            f"| {cell(values('fwd', 'time_ratio_vs_reference_order'))} "
            f"| {cell(values('fwd_bwd', 'median_ms'), '{:.1f}', '')} "
            f"| {cell(values('fwd_bwd', 'time_ratio_vs_reference_order'))} "
            f"| {cell(values('fwd', 'time_ratio_vs_bare_experts'))} / "
            f"{cell(values('fwd_bwd', 'time_ratio_vs_bare_experts'))} |"
        )
    return "\n".join(lines)


def run_setting(run):
    """How the run's process allocated memory, its XLA flags, any forced expert path."""
    env = run["environment"]
    parts = []
    if env.get("reuse_freed_memory"):
        parts.append("`reuse_freed_memory()`")
    if env.get("glibc_tunables"):
        parts.append(f"`GLIBC_TUNABLES={env['glibc_tunables']}`")
    setting = " + ".join(parts) or "glibc defaults"
    # Virtual host devices (the tests' flag) change no kernel: not a setting.
    flags = " ".join(f for f in (env.get("xla_flags") or "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    if flags:
        setting += f"; `XLA_FLAGS={flags}`"
    forced = run.get("settings", {}).get("experts_implementation", "auto")
    return setting if forced == "auto" else f"{setting}; experts forced to `{forced}`"


def run_machine(run):
    """The device a run measured: the accelerator, or the CPU model."""
    env = run["environment"]
    if env.get("platform", "cpu") != "cpu":
        return env.get("device_kind")
    return f"{env.get('cpu_model')} {env.get('cpu_family_model')}"


def by_setting(runs):
    """Runs split by machine, then by `run_setting`: never mixed in a cell.

    Machines keep the order of their first run; within one, glibc
    defaults come first.
    """
    groups = {}
    for run in runs:
        # Layer runs of another --batch time other shapes: their own table.
        key = (run_machine(run), run_setting(run), run.get("settings", {}).get("batch", 1))
        groups.setdefault(key, []).append(run)
    machines = list(dict.fromkeys(key[0] for key in groups))
    ordered = sorted(groups.items(), key=lambda item: (
        machines.index(item[0][0]), item[0][1] != "glibc defaults", item[0][2]))
    return [(setting, group) for (_, setting, _), group in ordered]


def render(layer_runs, model_runs, soft_moe_runs=()):
    parts = []
    for label, table, runs in (
        ("`benchmarks/moe_layer.py`", layer_table, layer_runs),
        ("`benchmarks/models.py`", models_table, model_runs),
        ("`benchmarks/soft_moe_layer.py`", soft_moe_table, soft_moe_runs),
    ):
        for setting, group in by_setting(runs):
            parts += ["", f"{provenance(group, label)} Memory: {setting}.", "",
                      table(group)]
    parts += ["", "Cells: median over runs (min–max across runs). "
              "Generated by `benchmarks/report.py` from the scripts' JSON."]
    return "\n".join(parts[1:])


def replace_between_markers(text, body):
    if text.count(START_MARKER) != 1 or text.count(END_MARKER) != 1:
        raise ValueError(
            f"The README must contain exactly one {START_MARKER!r} and one "
            f"{END_MARKER!r} marker."
        )
    head, rest = text.split(START_MARKER)
    _, tail = rest.split(END_MARKER)
    return f"{head}{START_MARKER}\n{body}\n{END_MARKER}{tail}"


def write_readme(path, body):
    with open(path) as f:
        text = f.read()
    new = replace_between_markers(text, body)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", nargs="*", default=[],
                        help="JSON files of benchmarks/moe_layer.py")
    parser.add_argument("--models", nargs="*", default=[],
                        help="JSON files of benchmarks/models.py")
    parser.add_argument("--soft-moe", nargs="*", default=[],
                        help="JSON files of benchmarks/soft_moe_layer.py")
    parser.add_argument("--write-readme", default=None, metavar="README",
                        help="replace the marked section of this file")
    args = parser.parse_args(argv)
    if not (args.layer or args.models or args.soft_moe):
        parser.error("give at least one --layer, --models or --soft-moe JSON file")
    for path in args.layer + args.models + args.soft_moe:
        if not os.path.isfile(path):
            parser.error(f"no such file: {path!r}")
    body = render(load(args.layer), load(args.models), load(args.soft_moe))
    if args.write_readme:
        write_readme(args.write_readme, body)
    else:
        print(body)


if __name__ == "__main__":
    main()
