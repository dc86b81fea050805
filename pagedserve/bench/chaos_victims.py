"""Which process `bench chaos` kills next, found by process title under the `serve` supervisor.

Every component sets its title (`pagedserve: worker 0`, `pagedserve: scheduler`,
`pagedserve: tokenizer` for the tokenizer pool's router, `pagedserve:
tokenizer 1` for its tokenizer processes ...), so the live processes of one
`serve` are its descendants, read from /proc, sorted by title. Kills rotate
over the kinds asked for; within a kind (two tokenizer processes) the victim is
drawn at random. A kill counts as recovered once every kind has as many live
processes as before it, none of them the victim or one of its children (the
router's tokenizer processes die with it).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

KINDS = ("worker", "scheduler", "tokenizer", "router")  # tokenizer: a tokenizer process, not the router
KIND_HELP = ("worker: the model worker; scheduler; tokenizer: a tokenizer process of the pool; "
             "router: the tokenizer pool's router (its tokenizer processes go with it)")


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def process_title(pid: int) -> str:
    """The command line (a component's title) of `pid`; "" for one that is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kind_of(title: str) -> str | None:
    """The victim kind of a process title, None for one that is never a victim (the frontend...)."""
    words = title.split()
    if len(words) < 2 or words[0] != "pagedserve:":
        return None
    if words[1] == "tokenizer":
        return "router" if len(words) == 2 else ("tokenizer" if words[2].isdigit() else None)
    return words[1] if words[1] in ("worker", "scheduler") else None


def descendants(root: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Live (not zombie) descendants of `root`."""
    table = _proc_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, state) in table.items():
        if state != "Z":
            children.setdefault(parent, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def component_pids(serve_pid: int) -> dict[str, list[int]]:
    """kind -> sorted live pids of that kind under the `serve` process `serve_pid`."""
    found: dict[str, list[int]] = {}
    for pid in descendants(serve_pid):
        kind = kind_of(process_title(pid))
        if kind is not None:
            found.setdefault(kind, []).append(pid)
    return {kind: sorted(pids) for kind, pids in found.items()}


@dataclass(frozen=True, slots=True)
class Kill:
    kind: str
    pid: int
    before: dict[str, list[int]]  # the component pids when it was chosen
    gone: frozenset[int]  # the victim and its descendants: none may count as recovered


def recovered(kill: Kill, now: dict[str, list[int]]) -> bool:
    """Whether every kind is back to its count before `kill`, with none of the processes it took."""
    return all(len([p for p in now.get(kind, []) if p not in kill.gone]) >= len(pids)
               and not kill.gone.intersection(now.get(kind, [])) for kind, pids in kill.before.items())


class VictimChooser:
    """The next victim: kinds in turn (skipping one with no live process), a random pid within it."""

    def __init__(self, kinds: list[str], rng: random.Random):
        unknown = set(kinds) - set(KINDS)
        if not kinds or unknown:
            raise ValueError(f"kinds must be among {', '.join(KINDS)}; got {kinds}")
        self.kinds = list(kinds)
        self.rng = rng
        self._turn = 0

    def choose(self, pids: dict[str, list[int]], children_of=descendants) -> Kill | None:
        for _ in range(len(self.kinds)):
            kind = self.kinds[self._turn % len(self.kinds)]
            self._turn += 1
            if pids.get(kind):
                pid = self.rng.choice(pids[kind])
                return Kill(kind, pid, {k: list(v) for k, v in pids.items()}, frozenset([pid, *children_of(pid)]))
        return None
