"""``ampsweep capacity [OVERRIDES]``: the largest batch each configuration fits on this CUDA
GPU, found by trying, beside the one predicted from a run's memory measurements (on a CPU,
with ``--memory-budget``, the prediction alone).

Every configuration of the command (``precision=fp32,bf16`` gives two) is validated first, as
``ampsweep train`` does; then each is built, its memory measured (activation bytes per sample,
the model's batch-independent memory: ``measure.memory``) and its largest batch searched by
doubling then bisecting (``engine.capacity``). Each search is recorded as an MLflow run tagged
``ampsweep.capacity=true`` with ``mem/max_batch_measured`` beside ``mem/max_batch_predicted``.

From the same measurement, the step's memory part by part is predicted for every kind of mode
(``measure.capacity.by_mode``), at ``trainer.batch_size`` or ``--predict-batch``, with the
largest batch each fits in the budget; recorded beside as ``memory_by_mode.json``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ampsweep import console
from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.measure import capacity as cap
from ampsweep.tracking import store

DEFAULT_LIMIT = 1 << 20


def add_parser(sub) -> None:
    p = sub.add_parser(
        "capacity",
        help="find the largest batch each precision mode fits on this CUDA GPU",
        description="For each configuration (Hydra overrides, e.g. precision=fp32,bf16): the "
        "largest training batch that fits on this CUDA GPU, found by doubling then bisecting, "
        "beside the one predicted from the activation bytes per sample and the model's memory.",
    )
    p.add_argument(
        "--memory-budget",
        "--budget",
        metavar="SIZE",
        action=Spelled,
        help="the budget the prediction assumes, e.g. 80GiB (default: the GPU's memory)",
    )
    p.add_argument(
        "--predict-batch",
        type=int,
        metavar="N",
        help="the batch the memory of each mode is predicted at (default: trainer.batch_size)",
    )
    p.add_argument(
        "--limit", type=int, default=DEFAULT_LIMIT, help=f"largest batch tried ({DEFAULT_LIMIT})"
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_capacity, memory_budget_flag=None)


class Spelled(argparse.Action):
    """Stores the value, and in ``<dest>_flag`` the option that gave it: an option with two
    spellings is named in an error as the user typed it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        budget = parse_budget(args.memory_budget, args.memory_budget_flag)
        if args.limit < 1:
            raise ConfigError(f"--limit {args.limit} must be >= 1, e.g. --limit {DEFAULT_LIMIT}")
        if args.predict_batch is not None and args.predict_batch < 1:
            raise ConfigError(
                f"--predict-batch {args.predict_batch} must be >= 1, e.g. --predict-batch 64"
            )
        configs = plan(list(args.overrides), budget)
    except ConfigError as err:
        console.error(str(err))
        return 2
    rows = []
    for cfg in configs:
        rows.append(measure(cfg, budget, args.limit, args.predict_batch))
    print_rows(rows, budget)
    for row in rows:
        print_modes(row, budget)
    return 0


def parse_budget(text: str | None, flag: str | None = None) -> int | None:
    """The budget in bytes (None: none given); ``flag``: the option as typed."""
    if text is None:
        return None
    try:
        return cap.parse_size(text)
    except cap.SizeError as err:
        raise ConfigError(f"{flag or '--memory-budget'} {text}: {err}") from None


def plan(overrides: list[str], budget: int | None = None) -> list[Config]:
    """Every configuration of the command, validated. Raises ConfigError (before anything is
    built or recorded). Without a CUDA GPU only the prediction can be made, for a given
    ``budget``: out of memory on a CPU is not an error a search can catch."""
    from ampsweep.config.compose import load
    from ampsweep.config.sweeps import expand_sweep, is_hydra_override
    from ampsweep.engine import components
    from ampsweep.engine.build import preflight, select_device

    plain = [o for o in overrides if not is_hydra_override(o)]
    configs = [components.resolve(load(job)) for job in expand_sweep(plain)]
    for cfg in configs:
        if select_device(cfg.trainer.device).type != "cuda" and budget is None:
            raise ConfigError(
                f"trainer.device={cfg.trainer.device.name}: ampsweep capacity searches the "
                "largest batch on a CUDA GPU, and there is none here: add --memory-budget "
                "SIZE (e.g. 80GiB) for the prediction alone"
            )
        fsdp = cfg.trainer.strategy.name == "fsdp"
        if cfg.trainer.nproc != 1 and not fsdp:
            raise ConfigError(
                f"trainer.nproc={cfg.trainer.nproc}: ampsweep capacity measures one process "
                "on one GPU: drop trainer.nproc (a DDP rank holds the same per-GPU batch)"
            )
        if cfg.trainer.nproc != 1 and budget is None:  # FSDP: predicted per rank only
            raise ConfigError(
                f"trainer.strategy=fsdp trainer.nproc={cfg.trainer.nproc}: ampsweep capacity "
                "predicts what one rank of the sharded group holds but cannot search it in one "
                "process: add --memory-budget SIZE (e.g. 80GiB, one GPU's memory)"
            )
    preflight(configs)
    # Eager: torch.compile would recompile at every batch size tried.
    return [replace(c, trainer=replace(c.trainer, compile=False)) for c in configs]


def measure(cfg: Config, budget: int | None, limit: int, at: int | None = None) -> dict:
    """Build one configuration, predict its largest batch, search it, record both; predict its
    step's memory in every kind of mode at batch ``at`` (default: its own)."""
    import torch

    from ampsweep.engine import capacity
    from ampsweep.engine.build import build
    from ampsweep.runner.context import default_run_name

    setup = build(cfg)
    name = default_run_name(setup.cfg)
    cuda = setup.device.type == "cuda" and not capacity.per_rank(setup.cfg)
    doing = "searching" if cuda else "predicting (the search needs a CUDA GPU)"
    if capacity.per_rank(setup.cfg):
        doing = f"predicting per rank of {setup.cfg.trainer.nproc} under FSDP"
    console.console.print(f"[bold]{name}[/]: {setup.num_params:,} parameters, {doing} ...")
    metrics = capacity.prediction(setup, budget)
    found = capacity.largest_batch(setup, limit) if cuda else cap.Search(0)
    if cuda:
        metrics[cap.MAX_BATCH_MEASURED] = found.largest
        tried = ", ".join(f"{b}{'' if ok else ' (out of memory)'}" for b, ok in found.tried)
        console.console.print(f"  tried {tried}")
    row = {"name": name, "metrics": metrics, "limit_reached": found.limit_reached}
    bd = cap.breakdown(metrics, setup.cfg.precision.name, setup.cfg.trainer.batch_size)
    by_mode = cap.by_mode(bd, at or bd.batch, budget) if bd is not None else []
    row["modes"], row["measured"] = by_mode, bd
    row["run_id"] = record(setup.cfg, name, metrics, found.tried, by_mode)
    del setup
    if cuda:
        torch.cuda.empty_cache()
    return row


def record(cfg: Config, name: str, metrics: dict, tried: list, by_mode: list) -> str | None:
    if cfg.tracking.backend != Tracker.mlflow:
        return None
    from ampsweep.config.compose import flatten
    from ampsweep.tracking.recorder import MlflowRecorder

    tags = {
        store.PRECISION: cfg.precision.name,
        store.MODEL: cfg.model.name,
        store.DATASET: cfg.dataset.name,
        store.CAPACITY: "true",
    }
    recorder = MlflowRecorder.start(cfg.tracking, f"capacity-{name}", tags=tags)
    recorder.log_params(flatten(cfg))
    recorder.log_metrics(metrics, 0)
    recorder.log_json({"tried": [{"batch": b, "fits": ok} for b, ok in tried]}, "capacity.json")
    predicted = [
        {"modes": names, "batch": bd.batch, "parts_mib": bd.parts, "max_batch": largest}
        for names, bd, largest in by_mode
    ]
    recorder.log_json({"predicted": predicted}, "memory_by_mode.json")
    recorder.end(store.FINISHED)
    return recorder.run_id


def print_rows(rows: list[dict], budget: int | None) -> None:
    from rich import box
    from rich.table import Table

    where = cap.format_size(budget) if budget else "the GPU's memory"
    console.console.print(f"Largest batch (predicted for {where}; measured by trying)")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("run", "measured", "predicted", "error", "bytes/sample", "model MiB"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for r in rows:
        m = r["metrics"]
        measured = m.get(cap.MAX_BATCH_MEASURED)
        predicted = m.get(cap.MAX_BATCH_PREDICTED)
        err = cap.error_pct(predicted, measured)
        table.add_row(
            r["name"],
            "-" if measured is None else f"{measured:,.0f}" + ("+" if r["limit_reached"] else ""),
            "-" if predicted is None else f"{predicted:,.0f}",
            "-" if err is None else f"{err:+.1f}%",
            f"{m.get(cap.BYTES_PER_SAMPLE, 0):,.0f}",
            f"{m.get(cap.MODEL_MIB, 0):,.1f}",
        )
    console.console.print(table)
    for r in rows:
        if r["run_id"]:
            console.console.print(f"recorded {r['name']} as MLflow run {r['run_id']}")
    if any(r["limit_reached"] for r in rows):
        console.note("+: every batch up to --limit fit; raise --limit to search further")


SHORT = {"optimizer": "optim", "master_weights": "master", "autocast_cache": "cache"}


def print_modes(row: dict, budget: int | None) -> None:
    """The step's memory of each kind of mode, part by part, predicted from ``row``'s
    measurement, and the largest batch each fits in ``budget``."""
    from rich import box
    from rich.table import Table

    from ampsweep.report import memory

    measured = row["measured"]
    if not row["modes"] or measured is None:
        return
    batch = row["modes"][0][1].batch
    console.console.print(
        f"{row['name']}: a training step's memory at batch {batch} in MiB, measured in "
        f"{measured.mode} at batch {measured.batch}, predicted for the rest"
    )
    shown = [p for p in cap.PARTS if any(bd.parts.get(p) for _, bd, _ in row["modes"])]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    headers = ["mode", "step", *(SHORT.get(p, p) for p in shown)]
    headers += [f"max batch in {cap.format_size(budget)}"] if budget else []
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i else "left", no_wrap=True)
    for names, bd, largest in row["modes"]:
        cells = [
            names[0],
            memory.cell(bd.total),
            *(memory.cell(bd.parts.get(p, 0.0)) for p in shown),
        ]
        cells += ["-" if largest is None else f"{largest:,}"] if budget else []
        table.add_row(*cells)
    console.console.print(table, crop=False)
    same = "; ".join(f"{n[0]}: {', '.join(n[1:])}" for n, _, _ in row["modes"] if len(n) > 1)
    console.note(f"the same memory as the mode shown ({same})")
    guessed = sorted({p for _, bd, _ in row["modes"] for p in bd.estimated})
    if guessed:
        console.note(
            f"{', '.join(guessed)}: estimated from the parameters (every weight copied), not "
            f"measured in {measured.mode}: an upper bound"
        )
    if not measured.parts.get("other"):
        console.note("no step peak measured: temporaries and workspace (other) are not included")
