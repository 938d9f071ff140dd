"""Lane statistics, observed in one object and exported elsewhere (STYLE.md item 13).

Conventions, written once:
- tokens per round counts every token a round emits, the next frontier included (a + 1);
- acceptance = accepted drafts / drafted tokens;
- the verifier-only ceiling = emitted tokens / sum of verifier compute wall (DESIGN.md §9).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaneStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    """Target compute (evaluate + transforms + judge) wall, summed over rounds."""
    transport_s: float = 0.0
    wal_s: float = 0.0
    sign_s: float = 0.0
    tokens_per_round_hist: dict[int, int] = field(default_factory=dict)
    speculated: int = 0
    """Rounds drafted ahead, on the guess that the round before is fully accepted."""
    speculation_hits: int = 0
    """Speculative drafts used (the guess held); the rest were drafted again."""
    speculation_s: float = 0.0
    """Draft-thread wall spent speculating, off the critical path while rounds are away."""

    def observe_round(self, drafted: int, accepted: int, emitted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.tokens_per_round_hist[emitted] = self.tokens_per_round_hist.get(emitted, 0) + 1

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def verifier_ceiling(self) -> float:
        return self.emitted / self.verify_s if self.verify_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 6),
            "tokens_per_round": round(self.tokens_per_round, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "split_s": {
                "draft": round(self.draft_s, 6),
                "transport": round(self.transport_s, 6),
                "verify": round(self.verify_s, 6),
                "wal": round(self.wal_s, 6),
                "sign": round(self.sign_s, 6),
            },
            "verifier_ceiling_tokens_per_s": round(self.verifier_ceiling, 3),
            "speculation": {
                "rounds": self.speculated,
                "hits": self.speculation_hits,
                "seconds": round(self.speculation_s, 6),
            },
        }
