"""Benchmark output: a JSON file of every raw measurement, a Markdown report, PNG plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

COLUMNS = [("config", "config", "{}"), ("T", "temperature", "{:g}"), ("workload", "workload", "{}"),
           ("accept", "acceptance", "{:.1%}"), ("mean acc. len", "mean_acceptance_length", "{:.2f}"),
           ("rounds/req", "rounds_per_request", "{:.1f}"), ("TTFT s", "median_ttft_s", "{:.2f}"),
           ("decode tok/s", "decode_tokens_per_s", "{:.2f}"), ("E2E median s", "median_e2e_s", "{:.2f}"),
           ("E2E IQR s", None, None), ("speedup", "speedup_decode", "{:.2f}x"),
           ("paired speedup", "speedup_paired", "{:.2f}x"),
           ("E2E speedup", "speedup_e2e", "{:.2f}x"), ("mean TV", "mean_tv", "{:.3f}"),
           ("NLL", "nll", "{:.3f}"), ("dist-2", "distinct_2", "{:.3f}"), ("dist-3", "distinct_3", "{:.3f}"),
           ("k histogram", "k_histogram", None)]


def cell(row: dict, key: str | None, fmt: str | None) -> str:
    if key is None:
        return f"{row['e2e_q1_s']:.2f}–{row['e2e_q3_s']:.2f}"
    value = row.get(key)
    if value is None:
        return "—"
    if key == "k_histogram":
        return " ".join(f"{k}:{n}" for k, n in value.items())
    return fmt.format(value)


def markdown_table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(cell(r, key, fmt) for _, key, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def peer_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    head = ("| engine | config | T | workload | load s | TTFT s | decode tok/s | E2E median s "
            "| compared with ours | ours/theirs (decode) | our TTFT / theirs | E2E speedup (theirs/ours) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r: dict, key: str) -> str:
        return "—" if r.get(key) is None else f"{r[key]:.2f}x"

    for r in rows:
        lines.append(f"| {r['engine']} | {r['config']} | {r['temperature']:g} | {r['workload']} | "
                     f"{r.get('load_s') or 0:.1f} | {r['ttft_s']:.2f} | "
                     f"{r['decode_tokens_per_s']:.2f} | {r['median_e2e_s']:.2f} | "
                     f"{r.get('matched') or '—'} | {ratio(r, 'ours_over_theirs')} | {ratio(r, 'ttft_ours_over_theirs')} | "
                     f"{ratio(r, 'e2e_speedup')} |")
    return "\n".join(lines)


def write_report(out_dir: Path, suite: str, machine: dict, options: dict, records: list[dict],
                 rows: list[dict], peers: list[dict] | None = None, plots: bool = True
                 ) -> dict[str, Path]:
    """JSON and Markdown reports, and the PNG plots unless `plots` is False (no matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", suite)
    files = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md"}
    payload = {"suite": suite, "machine": machine, "options": options, "summary": rows,
               "records": records, "peers": peers or []}
    files["json"].write_text(json.dumps(payload, indent=1, default=str))
    if plots:
        files.update(write_plots(out_dir, stem, rows))
    md = [f"# specserve bench: {suite}", "",
          f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
          f"{machine['threads']} threads, dtype {machine['dtype']}, native kernels "
          f"{machine.get('kernel_isa') or 'off (PyTorch)'} ({machine['time']}).",
          f"Protocol: {options}.", "",
          "Speedup = median decode tokens/s over target-only in the same run; paired speedup = "
          "median over calls of decode tokens/s over the target-only call of the same seed and "
          "repeat (the same round of the round robin); E2E speedup = "
          "target-only median E2E over this median E2E. NLL = the target's mean negative "
          "log-likelihood per generated token; mean TV = realised TV(π, p) per verified draft "
          "position.", "", markdown_table(rows), ""]
    if machine.get("memory"):
        mem = machine["memory"]
        md += ["## Decode at the memory limit", "",
               f"Read bandwidth {mem['read_bandwidth_gbs']:.1f} GB/s ({machine['threads']} threads); "
               f"a target decode step reads {mem['bytes_per_token'] / 1e6:.0f} MB of weights, so "
               f"{mem['ceiling_tokens_per_s']:.1f} tokens/s is its ceiling before any KV cache read.",
               ""]
        md += [f"- target only, {r['workload']}: {r['decode_tokens_per_s']:.1f} tokens/s = "
               f"{100 * r['fraction_of_ceiling']:.0f}% of the ceiling at its context"
               for r in rows if r.get("fraction_of_ceiling") is not None] + [""]
    if machine.get("verify_cost_s"):
        from specserve.bench.verify_cost import format_verify_cost

        times = {int(k): v for k, v in machine["verify_cost_s"].items()}
        md += ["## Verify-pass cost on the target", "", format_verify_cost(times), ""]
    if peers:
        md += ["## Peer comparison", "", peer_table(peers), ""]
    md += [f"![{name}]({path.name})" for name, path in files.items() if path.suffix == ".png"]
    files["markdown"].write_text("\n".join(md) + "\n")
    return files


def _tv_and_k(name: str) -> tuple[int | None, float | None]:
    k = re.search(r"fixed (\d+)", name)
    tv = re.search(r"TV=([0-9.]+)", name)
    return (int(k.group(1)) if k else None), (float(tv.group(1)) if tv else (0.0 if k else None))


def write_plots(out_dir: Path, stem: str, rows: list[dict]) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    spec_rows = [r for r in rows if r["config"] != "target only"]

    def save(fig, name: str) -> None:
        path = out_dir / f"{stem}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files[name] = path

    by_k: dict[tuple, list] = {}
    for r in spec_rows:
        k, tv = _tv_and_k(r["config"])
        if k is not None and r["speedup_decode"] is not None:
            by_k.setdefault((k, "no bonus" in r["config"]), []).append((tv, r))
    for name, key, ylabel in [("speedup-vs-tv", "speedup_decode", "speedup vs target-only"),
                              ("nll-vs-tv", "nll", "target NLL per token")]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for (k, nobonus), pts in sorted(by_k.items()):
            pts = sorted((tv, r[key]) for tv, r in pts if r[key] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"k={k}{' no bonus' if nobonus else ''}")
        ax.set_xlabel("TV budget D")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = sorted((_tv_and_k(r["config"])[0], r["acceptance"]) for r in spec_rows
                 if _tv_and_k(r["config"])[0] is not None and r["acceptance"] is not None)
    if pts:
        ax.scatter(*zip(*pts))
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("acceptance")
    save(fig, "acceptance-vs-k")

    fig, ax = plt.subplots(figsize=(7, 4))
    workloads = sorted({r["workload"] for r in rows})
    configs = list(dict.fromkeys(f"{r['config']} T={r['temperature']:g}" for r in rows))
    width = 0.8 / max(1, len(configs))
    for i, c in enumerate(configs):
        vals = [next((r["decode_tokens_per_s"] for r in rows if r["workload"] == w and
                      f"{r['config']} T={r['temperature']:g}" == c), 0.0) for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], vals, width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=6)
    save(fig, "tokens-per-s")
    return files
