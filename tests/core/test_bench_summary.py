"""The bench's summary arithmetic: medians over repeats, ratios to plain and to the local lane
in the same run, the verifier-only ceiling and the ideal rate from measured costs."""

from __future__ import annotations

import pytest

from muser.benchmark import Sample, format_table, summarise


def sample(lane, repeat, tokens, wall, **kw):
    return Sample(lane, 0, repeat, list(range(tokens)), wall, **kw)


def test_ratios_ceiling_and_ideal_come_from_the_samples():
    split = {"draft": 0.5, "verify": 1.5, "transport": 0.25}
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        sample("plain", 1, 100, 2.0, split_s={"verify": 2.0}),
        sample("local", 0, 100, 0.5, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("local", 1, 100, 0.5, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("cluster@0ms", 0, 100, 1.0, drafted=80, accepted=40, rounds=50, split_s=split),
    ]
    out = summarise(samples)
    assert out["plain"]["tokens_per_s"] == pytest.approx(75.0)  # median of 100 and 50
    assert out["local"]["tokens_per_s"] == pytest.approx(200.0)
    assert out["local"]["ratio_to_plain"] == pytest.approx(200 / 75)
    assert out["cluster@0ms"]["ratio_to_local"] == pytest.approx(0.5)
    assert out["local"]["acceptance"] == pytest.approx(0.5)
    assert out["local"]["tokens_per_round"] == pytest.approx(2.0)
    assert out["local"]["verifier_ceiling"] == pytest.approx(200 / 3.0)
    assert out["local"]["ideal_tokens_per_s"] == pytest.approx(200 / 4.0)  # 200 / (1.0 + 3.0)
    assert out["plain"]["ideal_tokens_per_s"] is None  # no draft cost measured
    table = format_table(out)
    assert "×local" in table and "ideal" in table
    cluster_line = next(line for line in table.splitlines() if line.startswith("cluster@0ms"))
    assert " 0.50 " in cluster_line
