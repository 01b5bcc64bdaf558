"""`moemesh model eval|train|stats`: the model's own commands."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .registry import BUILTIN_CONFIGS, DEFAULT_MODEL, WEIGHTS_DIR
from .vocab import FULL_PRECISION, VARIANTS


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="evaluate, train or profile the MoE model")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")

    ev = msub.add_parser("eval", help="held-out bits per byte and perplexity")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="name or checkpoint folder (tiny-moe)")
    ev.add_argument(
        "--variant",
        action="append",
        choices=VARIANTS,
        help="expert variant to score with, repeatable (default: fp16 only), e.g. --variant int4",
    )
    ev.add_argument("--windows", type=int, default=128, help="held-out windows of 256 bytes (128)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ev.set_defaults(handler=_eval)

    st = msub.add_parser(
        "stats", help="gate statistics and quality penalties from calibration text"
    )
    st.add_argument("--model", default=DEFAULT_MODEL, help="name or checkpoint folder (tiny-moe)")
    st.add_argument(
        "--out", type=Path, help="output file (default: beside the weights)"
    )
    st.add_argument("--tokens", type=int, default=16384, help="calibration tokens (16384)")
    st.add_argument("--window", type=int, default=256, help="calibration window length (256)")
    st.add_argument("--pairs", type=int, default=1, help="measured substitutes per expert (1)")
    st.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    st.add_argument("--json", action="store_true", help="print the summary as JSON")
    st.set_defaults(handler=_stats)

    tr = msub.add_parser(
        "train", help="train a built-in model (tiny-moe, tiny-moe-fg) from scratch, repeatably"
    )
    tr.add_argument(
        "--model", default=DEFAULT_MODEL, choices=sorted(BUILTIN_CONFIGS),
        help="which built-in model, e.g. tiny-moe-fg (default tiny-moe)",
    )
    tr.add_argument(
        "--out", type=Path, help="output folder (default: the model's folder in moe/weights)"
    )
    tr.add_argument("--steps", type=int, help="training steps (default 1500)")
    tr.add_argument("--threads", type=int, help="torch threads (default 1; changes the result)")
    tr.set_defaults(handler=_train)


def _progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        transient=True,
    )


def _eval(args: argparse.Namespace) -> int:
    from . import load
    from .evaluate import evaluate, heldout_batch, perplexity_delta_pct
    from .executors import variant_executor

    if args.windows < 1:
        raise ValueError(f"--windows must be >= 1, got {args.windows}")
    model = load(args.model)
    batch = heldout_batch(count=args.windows)
    variants = args.variant or [FULL_PRECISION]
    if FULL_PRECISION not in variants:
        variants = [FULL_PRECISION, *variants]
    results: dict[str, dict] = {}
    started = time.perf_counter()
    with _progress() as bar:
        for variant in variants:
            task = bar.add_task(f"eval {variant}", total=batch.shape[0], info="")
            executor = None if variant == FULL_PRECISION else variant_executor(model, variant)
            results[variant] = evaluate(
                model,
                batch,
                executor,
                progress=lambda d, t, task=task: bar.update(task, completed=d),
            )
    exact = results[FULL_PRECISION]
    out = {"model": str(args.model), **exact, "variants": {}}
    for variant, res in results.items():
        out["variants"][variant] = {**res, "perplexity_delta_pct": perplexity_delta_pct(exact, res)}
    out["seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"model {args.model}: {exact['tokens']} held-out bytes")
        for variant, res in out["variants"].items():
            print(
                f"  {variant:5s} bits/byte {res['bits_per_byte']:.4f}  perplexity "
                f"{res['perplexity']:.4f}  ({res['perplexity_delta_pct']:+.2f}%)"
            )
    return 0


def _stats(args: argparse.Namespace) -> int:
    from .stats import run_stats

    for flag in ("tokens", "window", "pairs", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    with _progress() as bar:
        task = bar.add_task("stats", total=None, info="")

        def show(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, info=what)

        stats, path = run_stats(
            args.model,
            args.out,
            calib_tokens=args.tokens,
            window=args.window,
            substitution_pairs=args.pairs,
            threads=args.threads,
            progress=show,
        )
    summary = {"out": str(path), **stats.summary()}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"gate statistics written to {path}")
        for key, value in summary.items():
            if not isinstance(value, dict | list):
                print(f"  {key}: {value}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from .train import TRAIN_SETTINGS, TrainSettings, train

    settings = TRAIN_SETTINGS[args.model]
    out = args.out or WEIGHTS_DIR / args.model
    overrides = {k: v for k, v in (("steps", args.steps), ("threads", args.threads)) if v}
    if any(v < 1 for v in overrides.values()):
        raise ValueError(f"--steps and --threads must be >= 1, got {overrides}")
    settings = TrainSettings(**{**settings.__dict__, **overrides})
    with _progress() as bar:
        task = bar.add_task("train", total=settings.steps, info="")

        def show(step: int, bpb: float, secs: float) -> None:
            bar.update(task, completed=step, info=f"bits/byte {bpb:.3f}  {secs:.0f}s")

        info = train(BUILTIN_CONFIGS[args.model], settings, out, show)
    print(json.dumps({"model": args.model, "out": str(out), **info}, indent=2))
    return 0
