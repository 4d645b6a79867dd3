"""The frontier suite's output: JSON of every call, a Markdown report (every configuration with
its paired figures, the lossless controls, the settings on the speed/accuracy frontier) and
the frontier PNG (speedup against accuracy and against the paired difference, with their
intervals, one curve per method, one row of panels per temperature).

`python -m specserve.bench.frontier_report RUN_DIR... [--out DIR] [--docs docs/fidelity.md]
[--repeat DIR]` recomputes the summary from runs' records (every piece's, `bench/
frontier_records.py`, or `frontier.json`; several runs, e.g. one per temperature, are
pooled), rewrites the report with how many items each configuration has, and with `--docs`
writes its tables and plot into the doc between the `BEGIN`/`END` markers. `--repeat DIR`
adds a run that repeated some cells: the report says, per configuration, on how many of them
the two calls gave the same output.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from specserve.bench import frontier_records
from specserve.bench.frontier_summary import (coverage, pareto, repeat_agreement,
                                              summarize_frontier)

METHOD_STYLE = {"target only": ("black", "s"), "lossless (default)": ("tab:gray", "D"),
                "lossless": ("tab:brown", "d"), "mentored": ("tab:blue", "o"),
                "mentored (entropy)": ("tab:green", "^"), "FLy (specserve)": ("tab:red", "v"),
                "FLy (published)": ("tab:purple", "P")}
KINDS = (("humaneval", "HumanEval"), ("code_edit", "code"), ("arithmetic", "arith."),
         ("extraction", "extr."))
BEGIN, END = "<!-- frontier-results:begin -->", "<!-- frontier-results:end -->"
LEGEND = ("Items are the unit: a cell is one configuration's calls on one item; its score is "
          "the mean of its calls' outcomes. † marks a deterministic configuration (one "
          "distinct output per item across its calls), counted once per item. Accuracy: "
          "Wilson 95% interval over items (a bootstrap over items when seeds disagree). Δ: "
          "accuracy minus target only's on the same items, Newcombe's paired 95% interval and "
          "McNemar's exact p (sign-flip test and bootstrap interval when cells hold fractions). "
          "Speedup: geometric mean over items of target-only seconds per generated token over "
          "the configuration's (each cell's median over its calls, prefill included), "
          "bootstrap 95% interval over items; decode speedup likewise from tokens/s after "
          "the first token. Mean TV: realised TV(π, p) per verified draft "
          "position (for FLy, 1 − p(x) at each deferral).")


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _interval(value, lo, hi, spec: str, suffix: str = "") -> str:
    if value is None:
        return "—"
    if lo is None or hi is None:
        return f"{value:{spec}}{suffix}"
    return f"{value:{spec}}{suffix} [{lo:{spec}}, {hi:{spec}}]"


def _speedup(r: dict, name: str) -> str:
    return _interval(r.get(name), r.get(f"{name}_lo"), r.get(f"{name}_hi"), ".2f", "x")


def _name(r: dict) -> str:
    return r["config"] + (" †" if r["deterministic"] else "")


def _p(r: dict) -> str:
    if r["p_value"] is None:
        return "—"
    b_c = f", {r['discordant'][0]}/{r['discordant'][1]}" if r["discordant"] else ""
    return f"{r['p_value']:.3g} ({r['test']}{b_c})"


def table(rows: list[dict]) -> str:
    head = ("| config | T | items | calls (distinct) | accuracy [95% CI] | Δ vs target [95% CI] "
            "| p (test, b/c) | " + " / ".join(label for _, label in KINDS) + " | speedup "
            "[95% CI] | decode speedup [95% CI] | accept | mean TV | NLL creative "
            "| dist-2 creative |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        kinds = r["accuracy_by_kind"]
        by_kind = " / ".join(_fmt(kinds.get(k), ".0%") for k, _ in KINDS)
        lines.append(
            f"| {_name(r)} | {r['temperature']:g} | {r['items']} | {r['calls']} "
            f"({r['distinct_outputs']}) | "
            f"{_interval(r['accuracy'], r['accuracy_lo'], r['accuracy_hi'], '.1%')} | "
            f"{_interval(r['delta'], r['delta_lo'], r['delta_hi'], '+.1%')} | {_p(r)} | "
            f"{by_kind} | {_interval(r['speedup'], r['speedup_lo'], r['speedup_hi'], '.2f', 'x')} "
            f"| {_speedup(r, 'speedup_decode')} "
            f"| {_fmt(r['acceptance'], '.1%')} | {_fmt(r['mean_tv'], '.3f')} | "
            f"{_fmt(r['nll'], '.3f')} | {_fmt(r['distinct_2'], '.3f')} |")
    return "\n".join(lines)


def control_table(rows: list[dict]) -> str:
    """The lossless rows: their true difference from target only is zero, so their interval
    shows what difference this run can resolve, and must contain 0."""
    lines = ["| T | control | items × calls | same text as target | Δ vs target [95% CI] | "
             "0 inside | p (test) | speedup [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["control"] or r["delta"] is None:
            continue
        inside = "—" if r["delta_lo"] is None else \
            ("yes" if r["delta_lo"] <= 0 <= r["delta_hi"] else "**no**")
        lines.append(f"| {r['temperature']:g} | {_name(r)} | {r['items']} × "
                     f"{r['min_calls_per_cell']} | {r.get('same_text', '—')} / "
                     f"{r['paired_items']} | "
                     f"{_interval(r['delta'], r['delta_lo'], r['delta_hi'], '+.1%')} | {inside} "
                     f"| {_p(r)} | "
                     f"{_interval(r['speedup'], r['speedup_lo'], r['speedup_hi'], '.2f', 'x')} |")
    return "\n".join(lines)


def frontier_table(rows: list[dict]) -> str:
    """Per temperature, the settings no other beats on both speedup and task accuracy."""
    lines = ["| T | method | setting | speedup [95% CI] | accuracy [95% CI] | Δ vs target |",
             "|---|---|---|---|---|---|"]
    for t in sorted({r["temperature"] for r in rows}):
        for r in pareto([r for r in rows if r["temperature"] == t], "speedup", "accuracy"):
            lines.append(f"| {t:g} | {r['method']} | {r['setting'] or '—'} | "
                         f"{_interval(r['speedup'], r['speedup_lo'], r['speedup_hi'], '.2f', 'x')}"
                         f" | {_interval(r['accuracy'], r['accuracy_lo'], r['accuracy_hi'], '.1%')}"
                         f" | {_interval(r['delta'], r['delta_lo'], r['delta_hi'], '+.1%')} |")
    return "\n".join(lines)


def coverage_table(records: list[dict], total: int | None) -> str:
    """How many task items each configuration has recorded, of the run's `total`."""
    of = f" of {total}" if total else ""
    lines = [f"| T | config | items recorded{of} |", "|---|---|---|"]
    for (t, config), n in coverage(records).items():
        lines.append(f"| {t:g} | {config} | {n}{of.replace(' of ', ' / ')} |")
    return "\n".join(lines)


def repeat_table(agreement: list[dict]) -> str:
    lines = ["| T | config | cells called twice | same output | items that differ |",
             "|---|---|---|---|---|"]
    for r in agreement:
        lines.append(f"| {r['temperature']:g} | {r['config']} | {r['cells']} | {r['same']} | "
                     f"{', '.join(r['differ']) or '—'} |")
    return "\n".join(lines)


def markdown(rows: list[dict], machine: dict, options: dict, png: str | None,
             extra: str = "") -> str:
    md = [f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, torch "
          f"{machine.get('torch')}, {machine.get('threads')} threads, target "
          f"{machine.get('target')}, draft {machine.get('draft')}, weights "
          f"{machine.get('weights')} ({machine.get('time')}).", f"Protocol: {options}.", "",
          LEGEND, "", table(rows), "", "### Lossless controls", "", control_table(rows), "",
          "### Settings on the speed/accuracy frontier", "", frontier_table(rows), ""]
    if extra:
        md += [extra, ""]
    if png:
        md.append(f"![frontier]({png})")
    return "\n".join(md) + "\n"


def sections(records: list[dict], options: dict, repeat: list[dict] | None = None) -> str:
    """The coverage table (and the repeat check's, when there is one)."""
    total = options.get("tasks") if isinstance(options, dict) else None
    out = "### Items recorded\n\n" + coverage_table(records, total)
    if repeat is not None:
        out += "\n\n### Repeated calls\n\n" + repeat_table(repeat)
    return out


def write_frontier(out_dir: Path, machine: dict, options: dict, records: list[dict],
                   rows: list[dict], plots: bool = True,
                   repeat: list[dict] | None = None) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "frontier.json", "markdown": out_dir / "frontier.md"}
    files["json"].write_text(json.dumps({"suite": "frontier", "machine": machine,
                                         "options": options, "summary": rows,
                                         "records": records}, indent=1, default=str))
    if plots:
        files["png"] = write_frontier_png(out_dir / "frontier.png", rows)
    body = markdown(rows, machine, options, files["png"].name if plots else None,
                    sections(records, options, repeat))
    files["markdown"].write_text("# specserve bench: frontier\n\n" + body)
    return files


def write_docs(doc: Path, rows: list[dict], machine: dict, options: dict, run_dir: Path | str,
               png: Path | None, extra: str = "") -> None:
    """Replace the doc's text between `BEGIN` and `END` with this run's tables (and copy the
    plot beside the doc)."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc} has no {BEGIN} ... {END} section to fill")
    shown = None
    if png is not None:
        shown = doc.parent / "fidelity-frontier.png"
        shutil.copyfile(png, shown)
    body = f"Run: `{run_dir}`. " + markdown(rows, machine, options, shown and shown.name, extra)
    head, rest = text.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}{END}{rest.split(END, 1)[1]}")


def write_frontier_png(path: Path, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    panels = [("accuracy", "task accuracy"), ("delta", "accuracy − target only's (paired)")]
    fig, axes = plt.subplots(len(temps), 2, figsize=(12, 4.4 * len(temps)), squeeze=False)
    for row_axes, t in zip(axes, temps):
        at_t = [r for r in rows if r["temperature"] == t]
        for ax, (y, label) in zip(row_axes, panels):
            for method, (color, marker) in METHOD_STYLE.items():
                pts = [r for r in at_t if r["method"] == method and r["speedup"] is not None
                       and r[y] is not None]
                if pts:
                    _plot_method(ax, pts, y, color, marker, method)
            if y == "delta":
                ax.axhline(0.0, color="black", linewidth=0.6)
            ax.axvline(1.0, color="black", linewidth=0.6, linestyle=":")
            ax.set_xlabel("speedup over target only (geometric mean over items)")
            ax.set_ylabel(label)
            ax.set_title(f"T = {t:g}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _plot_method(ax, pts: list[dict], y: str, color: str, marker: str, label: str) -> None:
    pts = sorted(pts, key=lambda r: r["speedup"])
    xs, ys = [r["speedup"] for r in pts], [r[y] for r in pts]
    ax.plot(xs, ys, marker=marker, color=color, label=label,
            linestyle="-" if len(pts) > 1 else "none")
    for r in pts:
        lo, hi = r[f"{y}_lo"], r[f"{y}_hi"]
        xlo, xhi = r["speedup_lo"], r["speedup_hi"]
        ax.errorbar([r["speedup"]], [r[y]], yerr=_bar(r[y], lo, hi),
                    xerr=_bar(r["speedup"], xlo, xhi), fmt="none", ecolor=color, alpha=0.4,
                    capsize=2)
        if r["setting"]:
            ax.annotate(r["setting"], (r["speedup"], r[y]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))


def _bar(value: float, lo: float | None, hi: float | None) -> list | None:
    """Error bar lengths below and above (an interval may round past its point estimate)."""
    if lo is None or hi is None:
        return None
    return [[max(0.0, value - lo)], [max(0.0, hi - value)]]


def load_records(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """A run's records (every piece's calls, complete or not, else frontier.json's), machine
    and options (frontier.meta.json, written when the run starts)."""
    records = frontier_records.read_records(run_dir)
    if not records and (run_dir / "frontier.json").exists():
        records = json.loads((run_dir / "frontier.json").read_text())["records"]
    info = frontier_records.read_meta(run_dir)
    return records, info.get("machine", {}), info.get("options", {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild a frontier report from runs' records")
    ap.add_argument("run_dirs", type=Path, nargs="+",
                    help="one or more runs (e.g. one per temperature or task set), pooled")
    ap.add_argument("--out", type=Path, default=None,
                    help="where the pooled report goes (default: the first run's folder)")
    ap.add_argument("--docs", type=Path, default=None,
                    help="also write the tables into this doc, between its markers")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--repeat", type=Path, default=None,
                    help="a run that called some of the same cells again: report, per "
                    "configuration, on how many the outputs agree")
    ap.add_argument("--pack", action="store_true",
                    help="compress each run's records into frontier.records.jsonl.gz")
    args = ap.parse_args(argv)
    records, machine, options = [], {}, []
    for run_dir in args.run_dirs:
        recs, mach, opts = load_records(run_dir)
        records += recs
        machine = machine or mach
        options.append(opts)
    if not records:
        raise SystemExit(f"no frontier records in {', '.join(map(str, args.run_dirs))}")
    rows = summarize_frontier(records)
    out = args.out or args.run_dirs[0]
    pooled = options[0] if len(options) == 1 else {"runs": options}
    repeat = (repeat_agreement(records, load_records(args.repeat)[0])
              if args.repeat is not None else None)
    files = write_frontier(out, machine, pooled, records, rows, not args.no_plots, repeat)
    if args.docs is not None:
        where = ", ".join(str(d) for d in args.run_dirs)
        write_docs(args.docs, rows, machine, pooled, where, files.get("png"),
                   sections(records, pooled, repeat))
    if args.pack:
        for run_dir in args.run_dirs:
            frontier_records.pack(run_dir)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
