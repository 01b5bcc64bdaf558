"""study.json → study.md and the forest plots (PNG and SVG), from the figures only.

One forest plot per compared pair (policy against baseline): a panel per metric, a row per
world (its change and paired 95% CI, filled where the CI excludes 0), and below them the
mean across worlds with its hierarchical 95% CI (experiments.study.run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

__all__ = ["forest_plots", "study_markdown", "write_study"]

LABELS = {"mean_latency": "mean token latency", "ttft": "first token (TTFT)",
          "decode_latency": "decode tokens", "traffic": "traffic per token",
          "p99_latency": "p99 token latency", "quality": "perplexity vs exact"}

LEVEL_LABELS = {"local_exact": "local exact (home node, resident, fp16 or quantized)",
                "local": "on the home node (any kind, substitutes included)"}


def fmt_pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:+.{digits}f}%"


def _ci(pair: Sequence[float | None]) -> str:
    lo, hi = pair
    return "–" if lo is None or hi is None else f"[{lo:+.1f}, {hi:+.1f}]"


def fmt_share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "arm"


def _pairs(data: Mapping[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in data["comparisons"]:
        out.setdefault((c["policy"], c["baseline"]), []).append(c)
    return out


def _save(fig: Any, out: Path, stem: str, title: str) -> str:
    """Title, lay out and write `fig` as STEM.png and STEM.svg in `out`; returns the PNG's
    name."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    fig.savefig(out / f"{stem}.svg")
    plt.close(fig)
    return f"{stem}.png"


def forest_plots(data: Mapping[str, Any], out: Path) -> list[str]:
    """Write forest_<policy>_vs_<baseline>.png and .svg per pair; returns the PNG names."""
    names = []
    for (policy, base), comps in _pairs(data).items():
        worlds = [w["world"] for w in comps[0]["per_world"]]
        fig, axes = plt.subplots(1, len(comps), figsize=(3.2 * len(comps) + 1.5,
                                                         0.32 * len(worlds) + 1.8),
                                 sharey=True, squeeze=False)
        for ax, c in zip(axes[0], comps, strict=True):
            for y, w in enumerate(c["per_world"]):
                x, (lo, hi) = w["change_pct"], w["ci95_pct"]
                if x is None:
                    continue
                sig = lo is not None and (lo > 0 or hi < 0)
                if lo is not None:
                    ax.plot([lo, hi], [y, y], color="#1971c2", lw=1.2)
                ax.plot([x], [y], "s", color="#1971c2", mfc="#1971c2" if sig else "white",
                        ms=5)
            y = len(worlds) + 0.5
            lo, hi = c["hier_ci95_pct"]
            if c["mean_pct"] is not None and lo is not None:
                ax.fill([lo, c["mean_pct"], hi, c["mean_pct"]], [y, y - 0.35, y, y + 0.35],
                        color="#c92a2a")
            ax.axvline(0, color="black", lw=0.8)
            ax.set_title(LABELS.get(c["metric"], c["metric"]), fontsize=9)
            ax.set_xlabel("change vs " + base + " (%)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(axis="x", alpha=0.3)
        axes[0][0].set_yticks([*range(len(worlds)), len(worlds) + 0.5],
                              [*worlds, "mean (hier. CI)"])
        axes[0][0].invert_yaxis()
        names.append(_save(fig, out, f"forest_{_slug(policy)}_vs_{_slug(base)}",
                           f"{policy} vs {base}: per world (paired 95% CI; filled: "
                           f"excludes 0)"))
    return names


def level_plot(levels: Sequence[Mapping[str, Any]], out: Path) -> str | None:
    """levels.png and .svg: a panel per level, a row per world, each arm's share and its CI,
    the pooled mean with its hierarchical CI below; returns the PNG's name (None: no levels)."""
    kinds = list(dict.fromkeys(lv["level"] for lv in levels))
    if not kinds:
        return None
    arms = list(dict.fromkeys(lv["policy"] for lv in levels))
    worlds = [w["world"] for w in levels[0]["per_world"]]
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.6 * len(kinds) + 1.5,
                                                     0.32 * len(worlds) + 2.0),
                             sharey=True, squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, kind in zip(axes[0], kinds, strict=True):
        for a, arm in enumerate(arms):
            lv = next((x for x in levels if x["policy"] == arm and x["level"] == kind), None)
            if lv is None:
                continue
            dy = (a - (len(arms) - 1) / 2) * 0.18
            c = colours[a % len(colours)]
            for y, w in enumerate(lv["per_world"]):
                if w["value_pct"] is None:
                    continue
                lo, hi = w["ci95_pct"]
                if lo is not None:
                    ax.plot([lo, hi], [y + dy, y + dy], color=c, lw=1.2)
                ax.plot([w["value_pct"]], [y + dy], "s", color=c, ms=4,
                        label=arm if y == 0 else None)
            lo, hi = lv["hier_ci95_pct"]
            if lv["mean_pct"] is not None and lo is not None:
                y = len(worlds) + 0.5 + dy
                ax.plot([lo, hi], [y, y], color=c, lw=3)
                ax.plot([lv["mean_pct"]], [y], "D", color=c, ms=5)
        ax.set_title(LEVEL_LABELS.get(kind, kind).split(" (")[0], fontsize=9)
        ax.set_xlabel("share of expert executions (%)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks([*range(len(worlds)), len(worlds) + 0.5],
                          [*worlds, "mean (hier. CI)"])
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return _save(fig, out, "levels", "Where experts ran: per world (95% CI, requests resampled)")


def study_markdown(data: Mapping[str, Any], images: Sequence[str]) -> str:
    """study.md (see the module docstring of experiments.study.run for the statistics)."""
    worlds = data["worlds"]
    lines = [f"# Study: {data['scenario']}", "",
             f"{len(worlds)} worlds: {data['topologies']} topologies drawn by the scenario's "
             f"own generator (`{data['generator']['command']}`"
             + (f", scaled for {data['generator']['scaled_for']}"
                if data["generator"].get("scaled_for") else "")
             + f") x {data['seeds']} workload seeds, all drawn from study seed "
               f"{data['study_seed']}. The scenario file's sha256: "
               f"`{data.get('scenario_sha256') or 'unknown'}`.", ""]
    if data.get("missing_worlds"):
        lines += [f"> **Partial study**: {len(data['missing_worlds'])} of "
                  f"{len(worlds) + len(data['missing_worlds'])} worlds drawn are not complete "
                  f"on disk and are left out ({', '.join(data['missing_worlds'])}); the "
                  f"figures below are over the {len(worlds)} that are.", ""]
    if data.get("notes"):
        lines += ["Runs: " + "; ".join(data["notes"]) + ".", ""]
    lines += [f"**Versions differ**: {n}.\n" for n in data.get("version_notes", ())]
    lines += ["Per world, each policy is compared with its baseline paired by request (the "
              "report's bootstrap). Pooled: the **median** of the per-world changes; the "
              "**share** of worlds whose paired 95% CI is beyond 0 in the claimed direction "
              "(lower, where nothing is claimed) and, apart, in the other; the **mean** "
              "change across worlds with a **hierarchical 95% CI** (topologies resampled, a "
              "topology's seeds with it, then each drawn world's requests). A claim is judged "
              "on the hierarchical CI alone: held, not held, reversed.", ""]
    if any(c["metric"] == "quality" for c in data["comparisons"]):
        lines += ["Quality rows (vs exact): the arm's perplexity change against the exact "
                  "model on the identical held-out token set; per world its CI resamples the "
                  "positions (the worlds column counts worlds scored).", ""]
    claims = [c for c in data["comparisons"] if c["claim"]]
    lines += ["## Pre-registered claims", ""]
    if claims:
        lines += ["| claim | median | mean [hier. 95% CI] | share held | share reversed | "
                  "verdict |", "|---|---|---|---|---|---|"]
        for c in claims:
            cl = c["claim"]
            more = f" by > {cl['min_effect_pct']:g}%" if cl.get("min_effect_pct") else ""
            lines.append(f"| {cl['policy']} {cl['direction']} than {cl['baseline']} on "
                         f"{cl['metric']}{more} | {fmt_pct(c['median_pct'])} | "
                         f"{fmt_pct(c['mean_pct'])} {_ci(c['hier_ci95_pct'])} | "
                         f"{fmt_share(c['share_held'])} | {fmt_share(c['share_reversed'])} | "
                         f"**{c['verdict']}** |")
    else:
        lines.append("The scenario states no claims (`claims:`): the comparisons below are "
                     "exploratory; none was registered before the run.")
    lines += ["", "## Comparisons across worlds", "",
              "TTFT is the first generated token (prefill and the first step); decode is "
              "every later token; mean is all tokens.", "",
              "| policy | vs | metric | median | mean [hier. 95% CI] | share lower | "
              "share higher | worlds |", "|---|---|---|---|---|---|---|---|"]
    for c in data["comparisons"]:
        low, high = ((c["share_held"], c["share_reversed"]) if c["direction"] == "lower"
                     else (c["share_reversed"], c["share_held"]))
        lines.append(f"| {c['policy']} | {c['baseline']} | "
                     f"{LABELS.get(c['metric'], c['metric'])} | {fmt_pct(c['median_pct'])} | "
                     f"{fmt_pct(c['mean_pct'])} {_ci(c['hier_ci95_pct'])} | {fmt_share(low)} | "
                     f"{fmt_share(high)} | {c['worlds']} |")
    lines += _level_lines(data.get("levels", ()))
    lines += ["", "## Worlds", "", "| world | topology seed | workload seed | wall s | "
              "faithful | folder |", "|---|---|---|---|---|---|"]
    for w in worlds:
        wall = "–" if w.get("wall_s") is None else f"{w['wall_s']:.0f}"
        lines.append(f"| {w['name']} | {w['topology_seed']} | {w['workload_seed']} | {wall} | "
                     f"{w.get('faithful')} | [{w['folder']}]({w['folder']}/report.md) |")
    lines += ["", "## Per world", ""]
    for (policy, base), comps in _pairs(data).items():
        lines += [f"### {policy} vs {base}", "",
                  "| world | " + " | ".join(LABELS.get(c["metric"], c["metric"])
                                           for c in comps) + " |",
                  "|---|" + "---|" * len(comps)]
        for i, w in enumerate(comps[0]["per_world"]):
            cells = [f"{fmt_pct(c['per_world'][i]['change_pct'])} "
                     f"{_ci(c['per_world'][i]['ci95_pct'])}" for c in comps]
            lines.append(f"| {w['world']} | " + " | ".join(cells) + " |")
        lines.append("")
    if images:
        lines += ["## Forest plots", "", *[f"![{n}]({n})" for n in images], ""]
    return "\n".join(lines) + "\n"


def _level_lines(levels: Sequence[Mapping[str, Any]]) -> list[str]:
    """The arms' execution shares across worlds (experiments.study.levels)."""
    if not levels:
        return []
    out = ["", "## Where experts ran, across worlds", "",
           "Levels of one arm, not changes: the share of the measured tokens' expert "
           "executions, per world with its CI (requests resampled), pooled with the "
           "hierarchical CI. \"largest in\": the share of worlds where local exact is the "
           "largest category of the run's execution mix.", "",
           "| policy | executions | median | mean [hier. 95% CI] | range across worlds | "
           "largest in |", "|---|---|---|---|---|---|"]
    for lv in levels:
        vals = [w["value_pct"] for w in lv["per_world"] if w["value_pct"] is not None]
        span = f"{min(vals):.1f}–{max(vals):.1f}%" if vals else "–"
        lo, hi = lv["hier_ci95_pct"]
        mean = "–" if lv["mean_pct"] is None else f"{lv['mean_pct']:.1f}%"
        ci = "" if lo is None or hi is None else f" [{lo:.1f}, {hi:.1f}]"
        med = "–" if lv["median_pct"] is None else f"{lv['median_pct']:.1f}%"
        out.append(f"| {lv['policy']} | {LEVEL_LABELS.get(lv['level'], lv['level'])} | "
                   f"{med} | {mean}{ci} | {span} | {fmt_share(lv['share_largest'])} |")
    return out


def capacity_plot(data: Mapping[str, Any], out: Path) -> str:
    """capacity.png and .svg of a capacity study: a row per world, each arm's capacity (the
    highest load within the SLO) and its 95% bracket [sure_load, sure_miss)."""
    worlds = [w["name"] for w in data["worlds"]]
    arms = list(data["arms"])
    unit = data["worlds"][0]["unit"] if data["worlds"] else ""
    fig, ax = plt.subplots(figsize=(6.5, 0.4 * len(worlds) + 1.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    loads = [c[k] for caps in data["capacity"].values() for c in caps.values()
             for k in ("load", "sure_load", "sure_miss") if c.get(k)]
    floor = min(loads) / 2 if loads else 1.0
    for a, arm in enumerate(arms):
        dy = (a - (len(arms) - 1) / 2) * 0.18
        c = colours[a % len(colours)]
        for y, name in enumerate(worlds):
            cap = data["capacity"][name].get(arm)
            if cap is None:
                continue
            lo = cap["sure_load"] or floor
            hi = cap["sure_miss"] or (max(loads) * 2 if loads else floor)
            ax.plot([lo, hi], [y + dy, y + dy], color=c, lw=1.2, alpha=0.7)
            ax.plot([cap["load"] or floor], [y + dy], "o" if cap["load"] else "x", color=c,
                    ms=5, label=arm if y == 0 else None)
    ax.set_xscale("log")
    ax.set_yticks(range(len(worlds)), worlds)
    ax.invert_yaxis()
    ax.set_xlabel(f"capacity ({unit}; x: no load passed; line: the 95% bracket)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, out, "capacity", "Capacity per world: the highest load within the SLO")


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}x"


def capacity_markdown(data: Mapping[str, Any], images: Sequence[str]) -> str:
    """study.md of a capacity study (experiments.study.capacity)."""
    worlds = data["worlds"]
    first = worlds[0] if worlds else {"slo_ms": math.nan, "target": math.nan, "unit": ""}
    lines = [f"# Capacity study: {data['scenario']}", "",
             f"{len(worlds)} worlds drawn as `moemesh study` draws them (study seed "
             f"{data['study_seed']}; the scenario file's sha256: "
             f"`{data.get('scenario_sha256') or 'unknown'}`), each climbing the capacity "
             f"ladder: a policy's capacity is its highest load with at least "
             f"{100 * first['target']:.0f}% of requests within the {first['slo_ms']:g} ms SLO, "
             f"every lower load passing too; its throughput there is the max throughput at "
             f"the SLO.", ""]
    if data.get("missing_worlds"):
        lines += [f"> **Partial study**: {len(data['missing_worlds'])} worlds are not complete "
                  f"on disk and are left out ({', '.join(data['missing_worlds'])}).", ""]
    if data.get("notes"):
        lines += ["Runs: " + "; ".join(data["notes"]) + ".", ""]
    lines += [f"**Versions differ**: {n}.\n" for n in data.get("version_notes", ())]
    lines += ["## Max throughput at the SLO, across worlds", "",
              "Ratio of the policy's max throughput at the SLO to the baseline's. Geometric "
              "mean with a 95% CI from the topologies resampled (which world one lands in; "
              "within a world a capacity is a ladder step, read from its bracket). Higher: the "
              "policy's capacity is the higher ladder load; surely higher: its 95% bracket "
              "lies wholly above the baseline's. Exploratory: no claim names a capacity.", "",
              "| policy | vs | median ratio | geometric mean [95% CI] | worlds with a ratio "
              "(both passed a load) | higher in | lower in | surely higher in |",
              "|---|---|---|---|---|---|---|---|"]
    for c in data["capacity_comparisons"]:
        lo, hi = c["ci95_ratio"]
        ci = "" if lo is None or hi is None else f" [{lo:.2f}, {hi:.2f}]"
        lines.append(f"| {c['policy']} | {c['baseline']} | {fmt_ratio(c['median_ratio'])} | "
                     f"{fmt_ratio(c['geomean_ratio'])}{ci} | {c['worlds_with_ratio']} of "
                     f"{c['worlds']} | {fmt_share(c['share_higher'])} | "
                     f"{fmt_share(c.get('share_lower'))} | {fmt_share(c['share_surely_higher'])} |")
    arms = list(data["arms"])
    lines += ["", f"## Capacity per world ({first['unit']}; tok/s at the SLO; the 95% "
              "bracket)", "", "| world | " + " | ".join(arms) + " | wall s | faithful |",
              "|---|" + "---|" * (len(arms) + 2)]
    for w in worlds:
        cells = []
        for arm in arms:
            cap = data["capacity"][w["name"]].get(arm)
            if cap is None:
                cells.append("–")
                continue
            load = "none" if cap["load"] is None else f"{cap['load']:g}"
            tok = "" if cap["throughput_tok_s"] is None else f", {cap['throughput_tok_s']:.0f}"
            sure = (f" [{cap['sure_load'] if cap['sure_load'] is not None else 0:g}, "
                    f"{cap['sure_miss'] if cap['sure_miss'] is not None else '∞'})")
            cells.append(f"{load}{tok}{sure}")
        wall = "–" if w.get("wall_s") is None else f"{w['wall_s']:.0f}"
        lines.append(f"| [{w['name']}]({w['folder']}/capacity.md) | " + " | ".join(cells)
                     + f" | {wall} | {w.get('faithful')} |")
    lines += ["", "## Per world", ""]
    for c in data["capacity_comparisons"]:
        lines += [f"### {c['policy']} vs {c['baseline']}", "",
                  "| world | ratio | higher | lower | surely higher | note |",
                  "|---|---|---|---|---|---|"]
        for w in c["per_world"]:
            lines.append(f"| {w['world']} | {fmt_ratio(w['ratio'])} | {w['higher']} | "
                         f"{w.get('lower')} | {w['surely_higher']} | {w['note']} |")
        lines.append("")
    if images:
        lines += ["## Plot", "", *[f"![{n}]({n})" for n in images], ""]
    return "\n".join(lines) + "\n"


def write_study(out: Path, data: Mapping[str, Any]) -> Path:
    """study.json, study.md and the plots into `out`; returns study.md's path."""
    import json

    (out / "study.json").write_text(json.dumps(data, indent=1) + "\n")
    path = out / "study.md"
    if data.get("kind") == "capacity":
        path.write_text(capacity_markdown(data, [capacity_plot(data, out)]))
        return path
    images = forest_plots(data, out)
    levels = level_plot(data.get("levels", ()), out)
    if levels is not None:
        images.append(levels)
    path.write_text(study_markdown(data, images))
    return path
