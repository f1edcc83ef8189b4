"""``ampsweep reproduce RUN_ID [overrides...]``: train a recorded run again, from MLflow alone.

The run's logged ``config.yaml`` (the resolved config: the precision mode it actually ran) is
read from the configured store only (``tracking.uri``, else $MLFLOW_TRACKING_URI, else
outputs/mlflow.db), never from a path found in the run. It becomes a Hydra primary config
under ``outputs/reproduce/<run id>/config.yaml``, with the schema first in its defaults so
every key stays typed; extra overrides apply on top of it and are recorded as the new run's
``overrides`` tag. The new run is tagged ``reproduces=<run id>``. When the code differs from
the run's (git commit, dirty tree, ampsweep or torch version, or the code of a ``_target_``
component: its package version, git commit or module file) a warning says so first; at the
end a warning names any recorded fact about the data that differs (e.g. a text's digest), and
both runs' final metrics are printed side by side with their differences.

Before anything is imported, every ``_target_`` of the recorded config is checked against
what this project trusts (``cli.trust``: ampsweep's own builders, the packages of the current
folder, ``--trust PKG``): a stranger's config that names ``os.system`` is refused in one line.

The run's ``trainer.callbacks`` are never run: a callback is code that whoever recorded the run
named, and it is not part of what the run computes (the config hash leaves it out). A note
names the ones left out; callbacks given as overrides run, as in ``ampsweep train``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ampsweep import console
from ampsweep.cli import trust
from ampsweep.config.schema import ConfigError
from ampsweep.config.score import from_tags
from ampsweep.precision.modes import DERIVED_PRECISION
from ampsweep.tracking import artifacts, store

VERSION_TAGS = (store.GIT_COMMIT, store.GIT_DIRTY, store.AMPSWEEP_VERSION, store.TORCH_VERSION)
HEADER = """\
# Written by `ampsweep reproduce {run_id}` from the run's logged config.yaml.
# Rerun with: ampsweep train --config-path {folder} --config-name config [overrides]
defaults:
  - ampsweep_schema
  - override hydra/job_logging: none
  - override hydra/hydra_logging: none
  - _self_

hydra:
  run:
    dir: outputs/runs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}-reproduce-{short}
  job:
    name: ampsweep
    chdir: false

"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "reproduce",
        help="train a recorded MLflow run again and compare the two",
        description="Train RUN_ID again from its logged config (overrides apply on top), "
        "in a new run tagged reproduces=RUN_ID, then compare final metrics.",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    # The overrides take the rest of the line, where --trust may come too (argparse would not
    # take an option between two runs of positional arguments).
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="KEY=VALUE")
    p.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="PKG",
        help="run the recorded config's _target_ paths under PKG too (repeatable); by "
        "default only ampsweep's builders and the packages of the current folder run",
    )
    p.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    try:
        overrides, named = trust.take_trust_flags(list(args.overrides))
        return reproduce(args.run_id, overrides, (*args.trust, *named))
    except ConfigError as err:
        console.error(str(err))
        return 2


def _uri_of(overrides: list[str]) -> str | None:
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "tracking.uri":
            return value or None
    return None


def fetch(run_id: str, overrides: list[str]):
    """The run and its logged config text, from the configured store."""
    uri = store.resolve_uri(_uri_of(overrides))
    store.check(uri)
    client = store.client_for(uri)
    run = store.find_run(client, run_id)
    if run is None:
        raise ConfigError(
            f"RUN_ID={run_id}: no such run in the store {store.describe(uri)}: "
            "check the id, or pass tracking.uri=... (or set MLFLOW_TRACKING_URI)"
        )
    try:
        text = artifacts.read_text(client, run_id, "config.yaml")
    except Exception:
        raise ConfigError(
            f"RUN_ID={run_id}: the run has no config.yaml artifact (not an ampsweep run, or "
            "it failed before recording): nothing to reproduce"
        ) from None
    return uri, run, text


def code_differences(tags: dict[str, str], trusted: trust.Trust) -> list[str]:
    """How the code here differs from the code the run was recorded with."""
    import torch

    import ampsweep
    from ampsweep.runner.environment import git_state

    now = {store.AMPSWEEP_VERSION: ampsweep.__version__, store.TORCH_VERSION: torch.__version__}
    now.update(git_state())
    out = []
    for key in VERSION_TAGS:
        then, here = tags.get(key), now.get(key)
        if then != here:
            out.append(f"{key}: {then or '(not recorded)'} in the run, {here or '(none)'} here")
    dirty = [w for w, d in (("the run's", tags), ("this", now)) if d.get(store.GIT_DIRTY) == "true"]
    if dirty:  # same commit or not, uncommitted changes make the code unknown
        out.append(f"{' and '.join(dirty)} checkout had uncommitted changes: the code may differ")
    return out + target_differences(tags, trusted)


def target_differences(tags: dict[str, str], trusted: trust.Trust) -> list[str]:
    """How the code of each ``_target_`` component the run recorded differs from the code
    that imports now (its package version, git commit, module file). A target the tags name
    that is not trusted is not imported to compare it."""
    from ampsweep.engine.components import REGISTRIES
    from ampsweep.runner.environment import target_provenance

    out = []
    for section, registry in REGISTRIES.items():
        target = tags.get(store.target_tag(section))
        if not target:
            continue
        refused = trusted.problem(store.target_tag(section), target)
        if refused:
            out.append(f"{store.target_tag(section)}={target}: not compared ({refused})")
            continue
        try:
            now = target_provenance(registry.for_target(target).fn)
        except ConfigError as err:  # the reproduction itself will refuse it, in one line
            out.append(f"{store.target_tag(section)}: {err}")
            continue
        for field in store.TARGET_FIELDS:
            key = store.target_tag(section, field)
            then, here = tags.get(key), now.get(field)
            if then != here:
                out.append(f"{key}: {then or '(not recorded)'} in the run, {here or '(none)'} here")
    return out


def data_differences(uri: str, original: str, new: str) -> list[str]:
    """The recorded facts about the data (data.* tags: the text's digest, the Python that
    supplied it, the sample counts) that differ between a run and its reproduction."""
    client = store.client_for(uri)
    a, b = (client.get_run(r).data.tags for r in (original, new))
    keys = sorted(k for k in set(a) | set(b) if k.startswith(store.DATA_PREFIX))
    return [
        f"{k}: {a.get(k, '(not recorded)')} in the run, {b.get(k, '(not recorded)')} now"
        for k in keys
        if a.get(k) != b.get(k)
    ]


def primary_config(run_id: str, text: str, overrides: list[str], folder: Path) -> list[str]:
    """Write the run's config as a Hydra primary config; return the overrides to pass."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(text)
    cfg.trainer.resume = None  # a reproduction is a new run, never a continuation
    cfg.trainer.callbacks = []  # the recorder's code: only the user's own overrides add any
    plain = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == "precision":  # there are no config groups here: set the mode
            o, key = f"precision.name={value}", "precision.name"
        if key == "precision.name":
            for derived in DERIVED_PRECISION:
                cfg.precision[derived] = None
            cfg.precision.scaler.enabled = cfg.precision.scaler.dynamic = None
            if "fsdp" in cfg.precision:  # FSDP's policy defaults from the mode, as the scaler's
                cfg.precision.fsdp.param_dtype = cfg.precision.fsdp.reduce_dtype = None
        plain.append(o)
    folder.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(run_id=run_id, folder=folder, short=run_id[:8])
    (folder / "config.yaml").write_text(header + OmegaConf.to_yaml(cfg))
    return plain


def recorded_callbacks(text: str) -> list[str]:
    """The ``_target_`` of each of the ``trainer.callbacks`` a logged config names."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.create(text)
    trainer = (cfg.get("trainer") if isinstance(cfg, DictConfig) else None) or {}
    return [str(spec.get("_target_")) for spec in trainer.get("callbacks") or []]


def check_trust(run_id: str, text: str, overrides: list[str], trusted: trust.Trust) -> None:
    """Refuse a recorded config that would make ampsweep run code nobody here trusts (its
    ``trainer.callbacks`` are dropped, and a section the overrides replace is the user's)."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception as err:
        raise ConfigError(
            f"RUN_ID={run_id}: its config.yaml is not a config ({' '.join(str(err).split())}): "
            "nothing to reproduce"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"RUN_ID={run_id}: its config.yaml is not a mapping: nothing to run")
    trust.check_recorded(cfg, f"RUN_ID={run_id}: config.yaml")
    trust.check(cfg, trusted, skip=[*trust.overridden(overrides), "trainer.callbacks"])


def reproduce(run_id: str, overrides: list[str], trusted_names: tuple[str, ...] = ()) -> int:
    from ampsweep.cli.train import cmd_train
    from ampsweep.runner.context import CommandContext

    uri, run, text = fetch(run_id, overrides)
    trusted = trust.Trust.here(trusted_names)
    check_trust(run_id, text, overrides, trusted)  # before anything of the run is imported
    tags = run.data.tags
    recorded = tags.get(store.OVERRIDES)
    console.console.print(
        f"reproducing run {run_id} ({run.info.run_name}) from {store.describe(uri)}"
        + (f", recorded with overrides: {recorded}" if recorded else "")
        + (f"; applied here: {' '.join(overrides)}" if overrides else "")
    )
    for line in code_differences(tags, trusted):
        console.errors.print(f"[bold yellow]warning:[/] code differs: {line}", soft_wrap=True)
    dropped = recorded_callbacks(text)
    if dropped:
        console.note(
            f"the run's trainer.callbacks are not run ({', '.join(dropped)}): a reproduction "
            "runs only callbacks given here, e.g. 'trainer.callbacks=[{_target_: "
            "mypkg.hooks.MyCallback}]'"
        )
    folder = (Path("outputs") / "reproduce" / run_id).resolve()
    extra = primary_config(run_id, text, overrides, folder)
    console.console.print(f"config: {folder / 'config.yaml'}")
    command = CommandContext(extra_tags={store.REPRODUCES: run_id})
    code = cmd_train(["--config-path", str(folder), "--config-name", "config", *extra], command)
    new_id = command.outcomes[-1].run_id if command.outcomes else None
    if new_id:
        for line in data_differences(uri, run_id, new_id):
            console.errors.print(f"[bold yellow]warning:[/] data differs: {line}", soft_wrap=True)
        print_comparison(uri, run_id, new_id)
    return code


def compare(uri: str, original: str, new: str) -> list[tuple[str, float | None, float | None]]:
    """(metric, original's final value, new run's final value) for every metric of either."""
    client = store.client_for(uri)
    a = client.get_run(original).data.metrics
    b = client.get_run(new).data.metrics
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))]


# What the machine measured of a run (its cost, not its result): expected to vary between
# two runs of one config, so compared apart from the metrics that decide.
MACHINE = (store.SYSTEM_PREFIX, "mem/", "perf/")


def verdict(rows: list[tuple[str, float | None, float | None]]) -> str:
    """The comparison's first line: identical, or the deciding metrics that differ and by
    how much (the machine's measures aside)."""
    deciding = [r for r in rows if not r[0].startswith(MACHINE)]
    differ = [(k, x, y) for k, x, y in deciding if x != y]
    if not differ:
        return f"identical: all {len(deciding)} metrics that decide are equal"
    shown = ", ".join(
        f"{k} {y - x:+.6g}" if x is not None and y is not None else f"{k} (only in one run)"
        for k, x, y in differ[:5]
    )
    more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
    return f"differs in {len(differ)} of {len(deciding)} metrics that decide: {shown}{more}"


def print_comparison(uri: str, original: str, new: str) -> None:
    from rich.table import Table

    rows = compare(uri, original, new)
    console.console.print(verdict(rows))
    for title, part in (
        (f"run {original} vs its reproduction {new}", False),
        ("what the machine measured (system/, mem/, perf/: expected to vary)", True),
    ):
        table = Table(title=title, title_justify="left")
        for col in ("metric", "original", "reproduced", "difference"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for key, x, y in (r for r in rows if r[0].startswith(MACHINE) == part):
            diff = f"{y - x:+.6g}" if x is not None and y is not None else "-"
            table.add_row(key, _fmt(x), _fmt(y), diff)
        if table.row_count:
            console.console.print(table)
    held = score_held(uri, original, new)
    if held:
        console.console.print(held)


def score_held(uri: str, original: str, new: str) -> str:
    """Whether the reproduction's score held against the original's, judged by the score the
    original run recorded (its task's: direction and tolerance); "" without one."""
    client = store.client_for(uri)
    a, b = client.get_run(original).data, client.get_run(new).data
    judge = from_tags(a.tags, a.metrics)
    if judge is None or judge.name not in a.metrics or judge.name not in b.metrics:
        return ""
    x, y = a.metrics[judge.name], b.metrics[judge.name]
    change = judge.change(y, x)
    if change is None:
        return ""
    verdict = judge.verdict(change)
    word = {"held": "held", "better": judge.better_word, "worse": judge.worse_word}[verdict]
    return (
        f"{judge.title} {word}: {judge.show(y)} vs the original's {judge.show(x)} "
        f"({judge.show_change(change)}; {judge.within()} counts as held)"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"
