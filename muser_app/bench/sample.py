"""One measured run of one lane on one prompt: what every lane and peer of the bench returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sample:
    lane: str
    prompt: int
    repeat: int
    tokens: list[int]
    wall_s: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    split_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds the run cost, per process: the bench's own for our in-process lanes
    ("lane"), each daemon's for the cluster ("proposer", "verifier"); empty where unmeasured."""
    ahead: dict[str, int] = field(default_factory=dict)
    """A cluster run's drafting ahead (the proposer's `speculation` stats): rounds whose
    next draft was made while they were away ("rounds"), those drafts used ("hits"), those
    among them drafted on a guess ("guess_hits"), next drafts started on the early decision
    because the guess was wrong ("on_decision"; one may go unused when the width changes),
    requests sent on the decision ("sent_ahead") and those void ("ahead_void"); empty for
    other lanes."""

    def to_dict(self) -> dict:
        return self.__dict__.copy()


LaneFn = Callable[[list[int], int], Sample]
