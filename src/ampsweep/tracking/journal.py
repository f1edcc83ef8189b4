"""A run's journal: what the recorder sends to MLflow, written to a local file first.

Every metric batch, tag and param write and the run's end is appended to
``journal.jsonl`` in the run's checkpoint folder (JSON lines: ``{"seq": n, "op": ...}``)
before it goes to the store, and acknowledged (``{"ack": n}``) once the store took it. When
the store fails for longer than MLflow retries, nothing is lost: the unacknowledged records
wait in the file and are written, in order, when the store answers again: by the recorder
itself, at the run's end, or by the next command that opens the store (``ampsweep repair``).
A journal whose every record was acknowledged, the run ended, is removed.

Replaying a record twice is harmless: tags and params are set to the same values again, and
MLflow drops a metric point identical to one it holds (key, value, timestamp, step).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ampsweep.engine import run_folder
from ampsweep.tracking import store

NAME = "journal.jsonl"


class Journal:
    """The journal of one run, open for appending (thread-safe: the training thread and the
    metrics writer both use it). Without a ``path`` it keeps the waiting records in memory
    only (a run whose folder is not known yet)."""

    def __init__(self, path: Path | None = None, uri: str = "", run_id: str = ""):
        self.path = path
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._seq = 0
        self.pending: dict[int, dict] = {}  # seq -> op, not yet acknowledged by the store
        self._line({"journal": 1, "uri": uri, "run_id": run_id})

    def append(self, op: dict) -> int:
        with self._lock:
            self._seq += 1
            self.pending[self._seq] = op
            self._line({"seq": self._seq, **op})
            return self._seq

    def ack(self, seq: int) -> None:
        with self._lock:
            if self.pending.pop(seq, None) is not None:
                self._line({"ack": seq})

    def waiting(self) -> list[tuple[int, dict]]:
        with self._lock:
            return sorted(self.pending.items())

    def close(self) -> None:
        """Close; remove the file when the store holds everything it recorded."""
        with self._lock:
            if self._file is None:
                return
            self._file.close()
            self._file = None
            assert self.path is not None  # a journal with a file has its path
            if not self.pending:
                self.path.unlink(missing_ok=True)

    def _line(self, record: dict) -> None:
        if self._file is None:
            return
        # One write per line, flushed: a crash loses at most the line being written.
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def keep_in(self, path: Path, uri: str, run_id: str) -> None:
        """From now on, in the file ``path``, with the records still waiting."""
        with self._lock:
            waiting = sorted(self.pending.items())
            self.path = path
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
            self._line({"journal": 1, "uri": uri, "run_id": run_id})
            for seq, op in waiting:
                self._line({"seq": seq, **op})


def write(client, run_id: str, op: dict) -> None:
    """Write one journal record into the store."""
    # MLflow is imported where a run first records: a run with tracking=none never gets here
    from mlflow.entities import Metric, Param

    kind = op["op"]
    if kind == "metrics":
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in op["items"]]
        client.log_batch(run_id, metrics=metrics, synchronous=True)
    elif kind == "tags":
        store.set_tags(client, run_id, op["items"])
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in op["items"]])
    elif kind == "end":
        if op.get("error"):
            client.set_tag(run_id, store.ERROR, op["error"])
        elif store.ERROR in client.get_run(run_id).data.tags:  # an end said ahead of it
            client.delete_tag(run_id, store.ERROR)
        client.set_terminated(run_id, status=op["status"], end_time=op.get("time"))
    else:
        raise ValueError(f"unknown journal record {kind!r}")


def read(path: Path) -> tuple[dict, list[dict]]:
    """A journal file's header (uri, run_id) and its unacknowledged records, in order. A
    last line cut short by a crash is ignored."""
    header, ops, acked = {}, {}, set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "journal" in record:
            header = record
        elif "ack" in record:
            acked.add(record["ack"])
        elif "seq" in record:
            ops[record["seq"]] = record
    return header, [ops[s] for s in sorted(ops) if s not in acked]


def replay(path: Path, client) -> tuple[str, int]:
    """Write a journal's unacknowledged records into the store and remove the file; the
    run id and how many records were written. A store failure raises (the file stays)."""
    header, ops = read(path)
    run_id = header.get("run_id", "")
    for op in ops:
        write(client, run_id, op)
    os.unlink(path)
    return run_id, len(ops)


def journals_under(root: Path) -> list[Path]:
    """The journals left in the run folders under a checkpoint root."""
    return sorted(root.glob(f"*/*/{NAME}")) if root.is_dir() else []


def replay_all(uri: str, roots: list[Path]) -> list[str]:
    """Write every journal under ``roots`` kept for the store at ``uri`` whose run no live
    process owns (its owner writes its own), and remove it; what was written, one line each.
    A store still down raises its one line."""
    done, client = [], None
    for root in dict.fromkeys(roots):
        for path in journals_under(root):
            header, _ = read(path)
            if header.get("uri") != uri:
                continue
            try:
                held = run_folder.take(path.parent)  # the run's owner: nobody else replays it
            except run_folder.Owned:
                continue
            try:
                client = client or store.client_for(uri)
                run_id, n = replay(path, client)
            except Exception as err:
                raise store.fault(err, uri) or err from None
            finally:
                held.release()
            done.append(f"wrote {n} records of run {run_id} that waited in {path}")
    return done
