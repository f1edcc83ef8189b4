"""The commands of the docs, as a reader would type them: collected from README.md and docs/,
run in a temporary folder (tests/e2e/test_commands_as_written.py).

A fenced block in ``bash``/``sh``/``shell`` or ``python`` is runnable. HTML comments on the
lines directly above its fence say how it runs (they do not show on the rendered page):

* ``<!-- skip: REASON -->``: not run (a GPU, a cluster, the network, a server that runs until
  Ctrl-C); the test reports it skipped with REASON.
* ``<!-- run: OVERRIDES -->``: Hydra overrides added to each ``ampsweep train``, ``reproduce``,
  ``doctor`` and ``capacity`` command of the block, to keep it small
  (``trainer.max_steps=3``). The block is otherwise run as written.
* ``<!-- cwd: PATH -->``: the block starts in PATH (relative to the page's folder).
* ``<!-- file: PATH -->``: the block is a file the reader saves (a callback's module, a YAML
  config): it is written to PATH, in any language, and not run.

The blocks of one page run in order in one folder, as one reader's session: a copy of
``examples/`` and an empty MLflow store at ``outputs/mlflow.db`` (the default store of a
command run there). Each block starts in that folder (``cd`` lasts to the end of its block).
``ampsweep ...`` and ``python -m ampsweep ...`` run in this process (``cli.main.main``), other
commands in bash. ``source .venv/bin/activate`` does nothing (the suite's venv is active);
``pip install`` is not run, but each extra it names must be one of pyproject.toml's (the suite's
venv has them). ``RUN_ID`` stands for the newest run of the store that is not a sweep's parent,
``SWEEP_ID`` for the newest sweep's parent run. Each command must exit 0, unless the page
claims otherwise.

What a page claims of a command (``<!-- expect: prints "..." -->`` below its block), an output
it shows (a block marked ``<!-- output -->``) and a transcript (a ``text`` block of
``$ command`` lines, each followed by what it prints) are checked too: tests/docs_claims.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import docs_claims
import tomllib
from docs_claims import Claim, Outcome

REPO = Path(__file__).resolve().parents[1]
RUNNABLE = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python", "py": "python"}
# A ``file:`` marker makes a block of any language a file to write.
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|skip|cwd|file)\s*:\s*(?P<value>.*?)\s*-->\s*$")
OUTPUT = re.compile(r"^\s*<!--\s*output\s*(?::\s*(?P<quotes>.*?))?\s*-->\s*$")
# The commands whose Hydra overrides a ``run:`` marker extends.
TRAINING = {"train", "reproduce", "doctor", "capacity"}


def pages() -> list[Path]:
    """README.md and every page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    kind: str  # "shell", "python", "transcript" ($ lines), "output" or "file"
    code: str
    overrides: list[str] = field(default_factory=list)
    skip: str | None = None
    cwd: str | None = None
    file: str | None = None
    claims: list[Claim] = field(default_factory=list)
    quotes: str | None = None  # the file an output block quotes, relative to the repository

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"

    def steps(self) -> list[tuple[str, str]]:
        """The block's commands, each with the output a transcript shows after it."""
        if self.kind != "transcript":
            return [(line, "") for line in commands(self.code)]
        steps: list[tuple[str, str]] = []
        for line in self.code.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], ""))
            elif steps:
                steps[-1] = (steps[-1][0], steps[-1][1] + line + "\n")
        return steps


def blocks(page: Path) -> list[Block]:
    """The runnable blocks of a page, with their markers and claims."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group("indent")), m.group("fence"), m.group("lang").lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            # inside a list or an admonition the block is indented with its fence
            line = lines[i]
            body.append(line[indent:] if line[:indent].isspace() or not indent else line.lstrip())
            i += 1
        i += 1
        block = Block(page, start + 1, RUNNABLE.get(lang, "file"), "\n".join(body) + "\n")
        _markers_above(block, lines, start - 1)
        while i < len(lines) and (claim := _claim(block, lines[i], i + 1)):
            block.claims.append(claim)
            i += 1
        if block.file is not None:
            block.kind = "file"
        elif block.kind == "file" and block.code.startswith("$ "):
            block.kind = "transcript"
        _claims_are_checked(block)
        if block.kind != "file" or block.file is not None:
            out.append(block)
    return out


def _claims_are_checked(block: Block) -> None:
    """A claim no command of the block would check is refused: it would pass unchecked."""
    for claim in block.claims:
        if block.skip is not None or block.kind in ("file", "output"):
            raise ValueError(f"{block.where}: {claim.text!r}: a claim on a block not run")
        if claim.which.isdigit() and not 1 <= int(claim.which) <= len(block.steps()):
            raise ValueError(
                f"{block.where}: expect {claim.which}: the block has {len(block.steps())} "
                "command(s)"
            )


def _markers_above(block: Block, lines: list[str], above: int) -> None:
    while above >= 0:
        if shown := OUTPUT.match(lines[above]):
            block.kind, block.quotes = "output", shown.group("quotes")
        elif marker := MARKER.match(lines[above]):
            kind, value = marker.group("kind"), marker.group("value")
            if kind == "run":
                block.overrides = shlex.split(value) + block.overrides
            else:
                setattr(block, kind, value)
        else:
            return
        above -= 1


def _claim(block: Block, line: str, number: int) -> Claim | None:
    try:
        return docs_claims.parse(line)
    except ValueError as exc:
        raise ValueError(f"{block.page}:{number}: {exc}") from None


def commands(code: str) -> list[str]:
    """The logical lines of a shell block (backslash continuations joined, blank lines out)."""
    joined = re.sub(r"\\\n", " ", code)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def extras() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


class Session:
    """One page's folder and the state its blocks share; ``run`` runs one block and checks
    what the page claims of it."""

    def __init__(self, root: Path, empty_store: Path, output: Callable[[], str]):
        self.root, self.empty_store, self.output = root, empty_store, output
        self.namespace: dict = {"__name__": "__docs__"}
        self.printed = ""  # the output of the last block run, for an output block after it
        for folder in ("examples", "scripts"):  # what the docs name relative to a checkout
            shutil.copytree(REPO / folder, root / folder, dirs_exist_ok=True)

    def run(self, block: Block) -> None:
        cwd = (self.root / block.cwd).resolve() if block.cwd else self.root
        if block.kind == "file":
            (cwd / block.file).parent.mkdir(parents=True, exist_ok=True)
            (cwd / block.file).write_text(block.code)
            return
        if block.kind == "output":
            check_shown(block, self.printed)
            return
        if block.kind == "python":
            outcome = self._python(block, cwd)
            self._judge(block, [c for c in block.claims if c.about(1, 1)], outcome, "")
            self.printed = outcome.output
            return
        env: dict[str, str] = {}
        steps = block.steps()
        printed = []
        for n, (line, shown) in enumerate(steps, 1):
            claims = [c for c in block.claims if c.about(n, len(steps))]
            before = self._runs(cwd) if any(c.needs_runs for c in claims) else None
            outcome = self._command(block, line, cwd, env)
            if before is not None:
                outcome.runs = [r for i, r in self._runs(cwd).items() if i not in before]
            printed.append(outcome.output)
            self._judge(block, claims, outcome, shown)
            cwd = outcome.cwd
        self.printed = "".join(printed)

    def _judge(self, block: Block, claims: list[Claim], outcome: Outcome, shown: str) -> None:
        """Fail, naming the page and line, where the command broke a claim of the page."""
        code = next((c.code for c in claims if c.code is not None), 0)
        failures = [] if outcome.code == code else [f"exited {outcome.code}, not {code}"]
        for claim in claims:
            if claim.kind != "exit" and (why := docs_claims.check(claim, outcome)):
                failures.append(f"the page claims {claim.text!r}, but {why}")
        if shown and (missing := docs_claims.missing_line(shown, outcome.output, numbers=True)):
            failures.append(f"the page shows {missing!r} after it, which it did not print")
        if failures:
            ran = f" (run as: {outcome.ran})" if outcome.ran else ""
            raise AssertionError(
                f"{block.where}: {outcome.line}: {'; '.join(failures)}{ran}\n"
                f"{_tail(outcome.output)}"
            )

    def _store(self, cwd: Path) -> str:
        db = cwd / "outputs" / "mlflow.db"
        if not db.exists():
            db.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.empty_store, db)
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{db}"

    def _runs(self, cwd: Path) -> dict:
        """Every run of the store a command run in ``cwd`` records to, by id."""
        from ampsweep.tracking import store

        client = store.client_for(self._store(cwd))
        ids = [e.experiment_id for e in client.search_experiments()]
        return {r.info.run_id: r for r in client.search_runs(ids, max_results=10000)}

    def _placeholders(self, text: str, cwd: Path) -> str:
        if "RUN_ID" not in text and "SWEEP_ID" not in text:
            return text
        from ampsweep.tracking import store

        runs = sorted(self._runs(cwd).values(), key=lambda r: -r.info.start_time)
        sweeps = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
        trained = [r for r in runs if r not in sweeps and store.CAPACITY not in r.data.tags]
        for name, found in (("RUN_ID", trained), ("SWEEP_ID", sweeps)):
            if name in text:
                if not found:
                    raise AssertionError(f"{name}: no such run in the store yet")
                text = text.replace(name, found[0].info.run_id)
        return text

    def _command(self, block: Block, line: str, cwd: Path, env: dict) -> Outcome:
        """One command of the block, as a shell would run it; what it did."""
        line = self._placeholders(line, cwd)
        os.environ["PWD"] = str(cwd)  # what $PWD says in a shell there
        words = shlex.split(line, comments=True)
        assigned = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            assigned[key] = value
        done = Outcome(line, 0, "", cwd)
        if not words:
            env.update(assigned)
            return done
        head = words[0]
        if head == "cd":
            done.cwd = (cwd / os.path.expandvars(words[1])).resolve()
            return done
        if head == "export":
            for word in words[1:]:
                key, _, value = word.partition("=")
                env[key] = os.path.expandvars(value)
            return done
        if head == "source" and words[1:] == [".venv/bin/activate"]:
            return done
        if head == "pip":
            self._pip(block, line, words)
            return done
        if head == "ampsweep" or (
            head in ("python", "python3") and words[1:3] == ["-m", "ampsweep"]
        ):
            args = words[1:] if head == "ampsweep" else words[3:]
            args = [os.path.expandvars(a) for a in args]
            if args and args[0] in TRAINING:
                args = [*args, *block.overrides]
            return self._ampsweep(line, args, cwd, {**env, **assigned})
        return self._shell(line, cwd, {**env, **assigned})

    def _pip(self, block: Block, line: str, words: list[str]) -> None:
        known = extras()
        for word in words:
            for named in re.findall(r"\[([\w,-]+)\]", word):
                unknown = set(named.split(",")) - known
                if unknown:
                    raise AssertionError(
                        f"{block.where}: {line}: no such extra {sorted(unknown)} in pyproject.toml"
                    )

    def _ampsweep(self, line: str, args: list[str], cwd: Path, env: dict) -> Outcome:
        from ampsweep.cli import main as cli

        self._store(cwd)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        os.chdir(cwd)
        self.output()  # what came before is not this command's output
        try:
            code = cli.main(args)
        except SystemExit as exc:  # argparse's --help
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        finally:
            os.chdir(self.root)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return Outcome(line, code, self.output(), cwd, ran=f"ampsweep {shlex.join(args)}")

    def _shell(self, line: str, cwd: Path, env: dict) -> Outcome:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        full = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO / "src"), **env}
        res = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env=full, capture_output=True, text=True, timeout=300
        )
        return Outcome(line, res.returncode, res.stdout + res.stderr, cwd)

    def _python(self, block: Block, cwd: Path) -> Outcome:
        code = self._placeholders(block.code, cwd)
        self._store(cwd)
        os.chdir(cwd)
        self.output()
        try:
            exec(compile(code, block.where, "exec"), self.namespace)  # noqa: S102 - the docs' own code
        except Exception as exc:
            raise AssertionError(
                f"{block.where}: python block: {type(exc).__name__}: {exc}\n{_tail(self.output())}"
            ) from exc
        finally:
            os.chdir(self.root)
        return Outcome("python block", 0, self.output(), cwd)


def check_shown(block: Block, printed: str) -> None:
    """An output block: lines of what the block above printed (``printed``), or of the file
    it quotes, with the same numbers."""
    if block.quotes:
        text, source = (REPO / block.quotes).read_text(), block.quotes
    else:
        text, source = printed, "what the block above printed"
    if missing := docs_claims.missing_line(block.code, text, numbers=not block.quotes):
        raise AssertionError(
            f"{block.where}: the output shown has {missing!r}, which is not in {source} "
            f"(in this order)\n{_tail(text)}"
        )


def _tail(output: str) -> str:
    return "\n".join(output.splitlines()[-25:])
