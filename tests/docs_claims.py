"""What a docs example claims, and the check of each claim (tests/docs_blocks.py runs the
examples and hands each command's outcome here).

A claim is an HTML comment on the lines directly below a block's closing fence, invisible on
the page, next to the text that makes it:

* ``<!-- expect: CLAIM -->`` is about the block's last command, ``<!-- expect 2: CLAIM -->``
  about its second (logical lines, as a reader counts them, ``cd`` included),
  ``<!-- expect all: CLAIM -->`` about each of them.

CLAIM is one of:

* ``exit N``: the command exits N (without this claim it must exit 0);
* ``prints "TEXT"``: a line of its output (stdout and stderr) holds TEXT;
  ``prints 6 lines "TEXT"``: exactly six lines do; ``prints no "TEXT"``: none does;
* ``writes PATH``: the file PATH exists after it (relative to where the command ran);
* ``records nothing``: no run was added to the store;
* ``trains KEY=V1,V2``: the runs it recorded (a sweep's parent left out) have exactly these
  values of the param KEY, e.g. ``trains trainer.seed=10,11,12``.

In TEXT, ``...`` stands for any text and a run of spaces for any spaces.

A block marked ``<!-- output -->`` above its fence is what the runnable block before it
printed, as a reader sees it in a terminal: each of its lines must appear in that output, in
order, with other lines allowed between them (an abridged output); in its lines ``...``
stands for any text and each number for any number (the figures of another machine or run).
``<!-- output: docs/assets/demo_report.txt -->`` says the block quotes that file (relative to
the repository) instead: its lines must be there in order, with the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

EXPECT = re.compile(r"^\s*<!--\s*expect(?:\s+(?P<which>\d+|all))?\s*:\s*(?P<claim>.*?)\s*-->\s*$")
FORMS = {
    "exit": re.compile(r"exit (?P<code>\d+)"),
    "prints": re.compile(r'prints (?:(?P<count>no|\d+) (?:lines? )?)?"(?P<text>.+)"'),
    "writes": re.compile(r"writes (?P<path>\S+)"),
    "records": re.compile(r"records nothing"),
    "trains": re.compile(r"trains (?P<key>[\w.]+)=(?P<values>\S+)"),
}
# A number of a real run's output: a sign, thousands separators, decimals, an exponent; not
# the digits of a name (fc2, bf16, step-0012.pt stay as they are).
NUMBER = re.compile(r"(?<![\w.])[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")


@dataclass
class Claim:
    which: str  # "last", "all" or the 1-based number of the command
    text: str  # as written on the page
    kind: str
    args: dict = field(default_factory=dict)

    def about(self, n: int, of: int) -> bool:
        """Whether the claim is about command ``n`` of ``of``."""
        return self.which == "all" or int(self.which if self.which != "last" else of) == n

    @property
    def code(self) -> int | None:
        return int(self.args["code"]) if self.kind == "exit" else None

    @property
    def needs_runs(self) -> bool:
        return self.kind in ("records", "trains")


def parse(line: str) -> Claim | None:
    """The claim of a marker line, None if the line is no ``expect`` marker; a marker whose
    claim has no known form raises ValueError (a typo must not pass as a claim checked)."""
    m = EXPECT.match(line)
    if not m:
        return None
    text = m.group("claim")
    for kind, form in FORMS.items():
        if found := form.fullmatch(text):
            return Claim(m.group("which") or "last", text, kind, found.groupdict())
    raise ValueError(f"not a claim: {text!r} (forms: {', '.join(FORMS)})")


@dataclass
class Outcome:
    """What one command did."""

    line: str
    code: int
    output: str
    cwd: Path
    ran: str = ""  # an ampsweep command as it ran (with the page's overrides)
    runs: list | None = None  # the runs it recorded, where a claim asked


def check(claim: Claim, outcome: Outcome) -> str | None:
    """Why ``outcome`` breaks ``claim``; None when it keeps it."""
    a = claim.args
    if claim.kind == "exit":
        return None if outcome.code == claim.code else f"exited {outcome.code}"
    if claim.kind == "prints":
        pattern = line_pattern(a["text"], numbers=False)
        found = sum(1 for ln in outcome.output.splitlines() if pattern.search(ln))
        want = a["count"]
        if want is None:
            return None if found else "no line of its output says it"
        want = 0 if want == "no" else int(want)
        return None if found == want else f"{found} line(s) of its output say it"
    if claim.kind == "writes":
        return None if (outcome.cwd / a["path"]).exists() else f"{a['path']} does not exist"
    assert outcome.runs is not None, "the harness looks up the runs of a claim that needs them"
    if claim.kind == "records":
        return None if not outcome.runs else f"it recorded {len(outcome.runs)} run(s)"
    trained = [r for r in outcome.runs if r.data.tags.get("ampsweep.sweep") != "true"]
    values = sorted({r.data.params.get(a["key"], "(unset)") for r in trained}, key=_natural)
    want = sorted(set(a["values"].split(",")), key=_natural)
    return None if values == want else f"its runs have {a['key']}={','.join(values)}"


def _natural(value: str) -> tuple:
    return (0, float(value), "") if re.fullmatch(r"-?\d+(\.\d+)?", value) else (1, 0.0, value)


def line_pattern(text: str, numbers: bool) -> re.Pattern:
    """TEXT as a pattern: ``...`` any text, spaces any spaces, with ``numbers`` each number
    any number."""
    parts = []
    for i, piece in enumerate(text.split("...")):
        piece = piece.strip()  # the spaces around "..." are part of the text it stands for
        if i:
            parts.append(".*")
        pos = 0
        for m in NUMBER.finditer(piece) if numbers else ():
            parts.append(_literal(piece[pos : m.start()]))
            parts.append(NUMBER.pattern)
            pos = m.end()
        parts.append(_literal(piece[pos:]))
    return re.compile("".join(parts))


def _literal(text: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text)) if text else ""


def missing_line(expected: str, output: str, numbers: bool) -> str | None:
    """The first line of ``expected`` not found in ``output`` in order (see the module's
    docstring; with ``numbers``, each number stands for any number), None when all are."""
    lines = output.splitlines()
    pos = 0
    for want in expected.splitlines():
        if not want.strip() or want.strip() == "...":
            continue
        pattern = line_pattern(want, numbers)
        while pos < len(lines) and not pattern.search(lines[pos]):
            pos += 1
        if pos == len(lines):
            return want.strip()
        pos += 1
    return None
