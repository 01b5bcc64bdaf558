"""`moemesh topology random|check` and `moemesh scenario check`: descriptions, validated.

Handlers print a summary of what the file means once validated (or the file itself with
`--json`); a bad file raises `InputError` (a ValueError), which `moemesh` prints as
`FILE:LINE: FIELD: MESSAGE` with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.randomtopo import MAX_NODES, random_topology_yaml
from orchestrator.scenario.scenario import Scenario, scenario_to_data
from orchestrator.scenario.topology import Topology, load_topology, topology_to_data

__all__ = ["register", "scenario_summary", "topology_summary"]

MATRIX_MAX_NODES = 12  # beyond this a matrix no longer fits a terminal: print ranges only


def register(subparsers: argparse._SubParsersAction) -> None:
    topo = subparsers.add_parser("topology", help="make or check a topology file (one-way links)")
    topo_sub = topo.add_subparsers(dest="topology_command", required=True, metavar="ACTION")

    rnd = topo_sub.add_parser(
        "random", help="write a random heterogeneous topology in the HetRoute paper's ranges")
    rnd.add_argument("--nodes", type=int, default=10, help=f"number of nodes, 2..{MAX_NODES} "
                     "(e.g. 10)")
    rnd.add_argument("--seed", type=int, default=0, help="random seed; same seed, same file "
                     "(e.g. 7)")
    rnd.add_argument("--out", type=Path, default=None,
                     help="write here instead of stdout (e.g. topo10.yaml)")
    rnd.set_defaults(handler=_topology_random)

    check = topo_sub.add_parser("check", help="validate a topology file and summarise it")
    check.add_argument("file", type=Path, help="topology YAML (e.g. "
                       "experiments/scenarios/topologies/edge5.yaml)")
    check.add_argument("--json", action="store_true", help="print the validated topology "
                       "as JSON instead of a summary")
    check.set_defaults(handler=_topology_check)

    scen = subparsers.add_parser("scenario", help="check a scenario file")
    scen_sub = scen.add_subparsers(dest="scenario_command", required=True, metavar="ACTION")
    scheck = scen_sub.add_parser("check", help="validate a scenario file and summarise it")
    scheck.add_argument("file", type=Path,
                        help="scenario YAML (e.g. experiments/scenarios/quickstart.yaml)")
    scheck.add_argument("--json", action="store_true", help="print the validated scenario "
                        "(topology inline) as JSON instead of a summary")
    scheck.set_defaults(handler=_scenario_check)


def _topology_random(args: argparse.Namespace) -> int:
    text = random_topology_yaml(args.nodes, args.seed)
    if args.out is None:
        print(text, end="")
        return 0
    if args.out.parent and not args.out.parent.is_dir():
        raise ValueError(f"--out {args.out}: folder {args.out.parent} does not exist")
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({args.nodes} nodes, seed {args.seed})")
    return 0


def _checked(args: argparse.Namespace, load: Callable[[Any], Any],
             to_data: Callable[[Any], Any], summary: Callable[[Any], str]) -> int:
    """`topology check` and `scenario check`: the file read back as data, or a summary."""
    value = load(args.file)
    print(json.dumps(to_data(value), indent=2) if args.json
          else f"{args.file}: valid\n{summary(value)}")
    return 0


def _topology_check(args: argparse.Namespace) -> int:
    return _checked(args, load_topology, topology_to_data, topology_summary)


def _scenario_check(args: argparse.Namespace) -> int:
    return _checked(args, _scenario_here, scenario_to_data, scenario_summary)


def _scenario_here(path: Any) -> Scenario:
    """The scenario, with a `clock: virtual` that this host cannot keep refused (loading
    judges the file alone, so that a run may still take `--clock realtime` there)."""
    scenario = load_scenario(path)
    if scenario.clock == "virtual" and (why := scenario.virtual_blocker()):
        raise ValueError(f"{path}: clock: virtual cannot run here: {why}")
    return scenario


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _range(values: list[float], unit: str) -> str:
    lo, hi = min(values), max(values)
    if lo == hi:
        return f"{lo:g} {unit}"
    return f"{lo:g}-{hi:g} {unit} (median {statistics.median(values):g})"


def topology_summary(topology: Topology) -> str:
    """Nodes as a table; one-way delay and rate as row → column matrices (or ranges)."""
    shares = topology.user_shares()
    out = [f"topology {topology.name}: {len(topology.nodes)} nodes, {len(topology.links)} "
           f"one-way links"]
    if topology.description:
        out.append(f"  {topology.description}")
    rows = [["node", "device", "GPU TFLOPS", "mem GB/s", "GPU GB", "CPU GB", "H2D GB/s",
             "users"]]
    for n in topology.nodes:
        d = n.device
        mem = "-" if d.mem_gbps is None else f"{d.mem_gbps:g}"  # "-": FLOPs only
        rows.append([n.name, d.name, f"{d.gpu_tflops:g}", mem, f"{d.gpu_mem_gb:g}",
                     f"{d.cpu_mem_gb:g}", f"{d.h2d_gbps:g}", f"{shares[n.name]:.1%}"])
    out += ["", *_table(rows)]
    if len(topology.nodes) < 2:
        return "\n".join(out)
    specs = [lk.spec for lk in topology.links]
    quantities = [("delay, ms", "delay_ms"), ("rate, Mbit/s", "rate_mbit")]
    quantities += [(label, key) for label, key in (("jitter, ms", "jitter_ms"),
                                                   ("loss, %", "loss_pct"))
                   if any(getattr(s, key) for s in specs)]
    names = topology.names
    for label, key in quantities:
        values = [getattr(s, key) for s in specs]
        if len(names) > MATRIX_MAX_NODES:
            unit = label.split(", ")[1]
            out += ["", f"one-way {label.split(',')[0]}: {_range(values, unit)}"]
            continue
        out += ["", f"{label} (row → column, one-way):"]
        matrix = [["", *names]]
        for a in names:
            matrix.append([a, *("-" if a == b else f"{getattr(topology.link(a, b), key):g}"
                                for b in names)])
        out += _table(matrix)
    asym = [(a, b) for a in names for b in names
            if a < b and topology.link(a, b) != topology.link(b, a)]
    if asym:
        out += ["", "asymmetric pairs: " + ", ".join(f"{a}↔{b}" for a, b in asym)]
    return "\n".join(out)


def scenario_summary(scenario: Scenario) -> str:
    """What the scenario will run, in words and numbers (scenario time)."""
    t, w, p = scenario.topology, scenario.workload, scenario.placement
    specs = [lk.spec for lk in t.links]
    links = (f", one-way delay {_range([s.delay_ms for s in specs], 'ms')}, rate "
             f"{_range([s.rate_mbit for s in specs], 'Mbit/s')}" if specs else "")
    if w.arrival == "poisson":
        arrival = f"poisson {w.rate_rps:g} req/s"
    elif w.arrival == "trace":
        assert w.trace is not None
        arrival = (f"arrival trace {Path(w.trace.path).name} ({w.trace.layout}) from "
                   f"{w.trace_start_s:g} s at {w.speed:g}x, token lengths x{w.token_scale:g} "
                   "clipped,")
    else:
        arrival = f"closed loop, {w.concurrency} in flight, think {w.think_s:g} s,"
    length = (f"for {w.duration_s:g} s" if w.duration_s is not None
              else f"until {w.requests} requests")
    expected = w.expected_requests
    shares = w.home_shares(t)
    tokens = {k: (f"{r.lo}" if r.lo == r.hi else f"{r.lo}-{r.hi}")
              for k, r in (("prompt", w.prompt_tokens), ("gen", w.gen_tokens))}
    tdf = "auto (measured)" if scenario.auto_dilation else f"{scenario.time_dilation:g}"
    rows = [
        ["model", f"{scenario.model.name} ({scenario.model.mode})"],
        ["runtime", f"{scenario.runtime}, shaper {scenario.shaper}, time dilation {tdf}"],
        ["topology", f"{t.name}: {len(t.nodes)} nodes{links}"],
        ["placement", f"{p.policy}, redundancy {p.redundancy:g}, variants "
                      f"{'/'.join(p.variants)}, seed {p.seed if p.seed is not None else w.seed}"],
        ["policies", ", ".join(scenario.policies)],
        ["workload", f"{arrival} {length}"
                     + (f" (~{expected:g} requests)" if expected is not None else "")
                     + f", warm-up {w.warmup_s:g} s, seed {w.seed}"],
        ["tokens", f"prompt {tokens['prompt']}, generate {tokens['gen']}"],
        ["home", ", ".join(f"{n} {s:.0%}" for n, s in shares.items())
                 + f" ({w.home if isinstance(w.home, str) else 'given'})"],
        ["quality", f"budget {scenario.quality_budget_pct:g}% per token"],
        ["SLO", f"a request's mean token latency <= {scenario.slo_ms:g} ms"],
    ]
    cap, parts = scenario.capacity, []
    if cap.loads is not None:
        parts.append("loads " + ", ".join(f"{v:g}" for v in cap.loads))
    if cap.time_dilation is not None:
        parts.append(f"time dilation {cap.time_dilation:g} at the scenario's load")
    if parts:
        rows.append(["capacity", ", ".join(parts)])
    out = [f"scenario {scenario.name}"]
    if scenario.description:
        out.append(f"  {scenario.description}")
    out += ["  " + line for line in _table(rows)]
    timeline = scenario.timeline()
    out.append(f"  faults     {len(scenario.faults)} ({len(timeline)} events)"
               if timeline else "  faults     none")
    for event in timeline:
        out.append(f"    at {event.at_s:g} s: {event.describe()}")
    return "\n".join(out)
