"""What every lane returns, and its one JSON shape (`muser generate --json`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from muser.stats import LaneStats


@dataclass
class GenerationResult:
    lane: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    stats: LaneStats
    rows: dict[int, np.ndarray] = field(default_factory=dict)
    """Optional: transcript position -> the target's raw logits row predicting the token at
    that position (recorded when asked, for the oracle comparison)."""

    def to_json(self) -> dict:
        return {
            "lane": self.lane,
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
        }
