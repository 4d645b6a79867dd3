"""The frontier suite's output: JSON of every call, a Markdown report (every configuration,
then the settings on the speed/accuracy frontier) and the frontier PNG: E2E speedup against
accuracy on the tasks, and against NLL and distinct-2 of the creative text, one curve per
method and one row of panels per temperature."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.bench.frontier import pareto

METHOD_STYLE = {"target only": ("black", "s"), "lossless": ("tab:gray", "D"),
                "mentored": ("tab:blue", "o"), "mentored (entropy)": ("tab:green", "^"),
                "FLy": ("tab:red", "v")}


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _accuracy(r: dict) -> str:
    if r["accuracy"] is None:
        return "—"
    return f"{r['accuracy']:.1%} [{r['accuracy_lo']:.1%}, {r['accuracy_hi']:.1%}]"


def table(rows: list[dict]) -> str:
    head = ("| config | T | task calls | accuracy [95% CI] | code / arith. / extr. | code exact "
            "| NLL creative | dist-2 creative | NLL tasks | accept | mean TV | E2E speedup "
            "| E2E speedup creative |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        kinds = r["accuracy_by_kind"]
        by_kind = " / ".join(_fmt(kinds.get(k), ".0%") for k in ("code_edit", "arithmetic",
                                                                 "extraction"))
        lines.append(
            f"| {r['config']} | {r['temperature']:g} | {r['task_calls']} | {_accuracy(r)} | "
            f"{by_kind} | {_fmt(r['code_exact'], '.0%')} | {_fmt(r['nll'], '.3f')} | "
            f"{_fmt(r['distinct_2'], '.3f')} | {_fmt(r['nll_tasks'], '.3f')} | "
            f"{_fmt(r['acceptance'], '.1%')} | {_fmt(r['mean_tv'], '.3f')} | "
            f"{_fmt(r['speedup_e2e'], '.2f')}x | {_fmt(r['speedup_e2e_creative'], '.2f')}x |")
    return "\n".join(lines)


def frontier_table(rows: list[dict]) -> str:
    """Per temperature, the settings no other beats on both E2E speedup and task accuracy."""
    lines = ["| T | method | setting | E2E speedup | accuracy [95% CI] | dist-2 creative |",
             "|---|---|---|---|---|---|"]
    for t in sorted({r["temperature"] for r in rows}):
        for r in pareto([r for r in rows if r["temperature"] == t], "speedup_e2e", "accuracy"):
            lines.append(f"| {t:g} | {r['method']} | {r['setting'] or '—'} | "
                         f"{r['speedup_e2e']:.2f}x | {_accuracy(r)} | "
                         f"{_fmt(r['distinct_2'], '.3f')} |")
    return "\n".join(lines)


def write_frontier(out_dir: Path, machine: dict, options: dict, records: list[dict],
                   rows: list[dict], plots: bool = True) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "frontier.json", "markdown": out_dir / "frontier.md"}
    files["json"].write_text(json.dumps({"suite": "frontier", "machine": machine,
                                         "options": options, "summary": rows,
                                         "records": records}, indent=1, default=str))
    if plots:
        files["png"] = write_frontier_png(out_dir / "frontier.png", rows)
    md = ["# specserve bench: frontier", "",
          f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, torch "
          f"{machine.get('torch')}, {machine.get('threads')} threads, weights "
          f"{machine.get('weights')} ({machine.get('time')}).", f"Protocol: {options}.", "",
          "Accuracy: share of task calls judged right (code edits: the calls give the expected "
          "results; arithmetic: the final number; extraction: the JSON object), Wilson 95% "
          "interval. NLL: the target's mean negative log-likelihood per generated token. E2E "
          "speedup: target-only seconds per generated token over this configuration's, on "
          "the same (prompt, seed) calls, prefill included. Mean TV: realised TV(π, p) per "
          "verified draft position (for FLy, 1 − p(x) at each deferral).", "",
          table(rows), "", "## Settings on the speed/accuracy frontier", "",
          frontier_table(rows), ""]
    if plots:
        md.append(f"![frontier]({files['png'].name})")
    files["markdown"].write_text("\n".join(md) + "\n")
    return files


def write_frontier_png(path: Path, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    panels = [("speedup_e2e", "accuracy", "task accuracy"),
              ("speedup_e2e_creative", "nll", "creative: target NLL / token (lower = likelier)"),
              ("speedup_e2e_creative", "distinct_2", "creative: distinct-2")]
    fig, axes = plt.subplots(len(temps), 3, figsize=(15, 4.2 * len(temps)), squeeze=False)
    for row_axes, t in zip(axes, temps):
        at_t = [r for r in rows if r["temperature"] == t]
        for ax, (x, y, label) in zip(row_axes, panels):
            for method, (color, marker) in METHOD_STYLE.items():
                pts = [r for r in at_t if r["method"] == method and r[x] is not None
                       and r[y] is not None]
                if not pts:
                    continue
                xs, ys = [r[x] for r in pts], [r[y] for r in pts]
                ax.plot(xs, ys, marker=marker, color=color, label=method,
                        linestyle="-" if len(pts) > 1 else "none")
                if y == "accuracy":
                    ax.errorbar(xs, ys, yerr=[[r[y] - r["accuracy_lo"] for r in pts],
                                              [r["accuracy_hi"] - r[y] for r in pts]],
                                fmt="none", ecolor=color, alpha=0.4, capsize=3)
                for r in pts:
                    if r["setting"]:
                        ax.annotate(r["setting"], (r[x], r[y]), fontsize=6,
                                    textcoords="offset points", xytext=(3, 3))
            if y == "accuracy":
                ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("E2E speedup over target only")
            ax.set_ylabel(label)
            ax.set_title(f"T = {t:g}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
