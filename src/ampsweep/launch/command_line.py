"""A train command line as Hydra reads it, and whether it trains at all: light (Hydra's
parser and the config layer, no torch), so the program's start-up (``cli.startup``) can ask
before it imports what training needs."""

from __future__ import annotations

import argparse
from pathlib import Path

# Private: Hydra's own parser of an app's command line (hydra.main builds it from sys.argv
# itself); checked on hydra-core 1.3.8, tests/unit/launch/test_hydra_app.py fails if it moves.
from hydra._internal.utils import get_args_parser

from ampsweep.config.compose import normalise_overrides


def hydra_args(args: list[str]) -> argparse.Namespace:
    """The command line as Hydra's own parser reads it (its flags, -m, the overrides), the
    config folders made absolute (Hydra reads a relative one relative to the module that calls
    it, inside ampsweep, not the folder the user is in) and each ``<section>.args.<key>=v``
    made Hydra's add-or-set."""
    parser = get_args_parser()
    parser.prog = "ampsweep train"  # a bad flag: argparse's usage line and exit 2
    parsed = parser.parse_intermixed_args(args)  # overrides before and after the flags
    for key in ("config_path", "config_dir"):
        if getattr(parsed, key):
            setattr(parsed, key, str(Path(getattr(parsed, key)).expanduser().resolve()))
    parsed.overrides = normalise_overrides(parsed.overrides)
    return parsed


def informational(parsed: argparse.Namespace | None) -> bool:
    """Hydra prints something (help, the config, completion) and trains nothing (None: a
    command line Hydra's parser refused)."""
    return parsed is None or bool(
        parsed.help or parsed.hydra_help or parsed.cfg or parsed.info or parsed.shell_completion
        or parsed.experimental_rerun
    )  # fmt: skip
