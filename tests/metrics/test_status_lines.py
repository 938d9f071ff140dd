"""`muser status` text: the batching lines of each daemon, from its Status JSON."""

from __future__ import annotations

from muser_app.cli.status import summary


def test_the_verifier_shows_its_target_batches_and_queue():
    status = {
        "batching": {"batches": 5, "mean_batch": 1.6, "batch_sizes": {"1": 3, "2": 1, "3": 1},
                     "queue_depth": 0, "queue_depth_max": 4, "queue_full": 2},
    }  # fmt: skip
    assert (
        "target batches 5 (mean 1.60 rounds, sizes 1×3 2×1 3×1)  queue now 0, max 4, refused full 2"
    ) in summary(status)


def test_the_verifier_shows_sessions_it_resumed_only_when_it_did():
    assert "resumed 2 session(s) from a proposer's signed round" in summary({"resumes": 2})
    assert not any("resumed" in line for line in summary({"resumes": 0, "wal": {}}))


def test_the_proposer_shows_its_draft_batches_and_whether_they_are_on():
    on = {"drafting": {"batch": True, "batch_sizes": {"8": 2, "1": 40}, "waiting": 0}}
    off = {"drafting": {"batch": False, "batch_sizes": {"1": 9}, "waiting": 0}}
    assert "draft batches on: sizes 1×40 8×2" in summary(on)
    assert "draft batches off (lane.draft_batch): sizes 1×9" in summary(off)
    idle = summary({"drafting": {"batch": True, "batch_sizes": {}}, "batching": {"batches": 0}})
    assert not any("batches" in line for line in idle)


def test_each_daemon_names_the_torch_forward_it_runs():
    proposer = {"draft_device": "torch:cpu", "draft_forward": "lean"}
    verifier = {"target": {"device": "torch:cpu", "forward": "transformers"}}
    assert "draft on torch:cpu, lean forward" in summary(proposer)
    assert "target on torch:cpu, transformers forward" in summary(verifier)
    assert "draft on mlx:cpu" in summary({"draft_device": "mlx:cpu", "draft_forward": None})


def test_a_pinned_daemon_names_its_cpus_and_an_unpinned_one_does_not():
    proposer = {"draft_device": "torch:cpu", "draft_forward": "lean", "cpus": [0, 1]}
    verifier = {"target": {"device": "torch:cpu", "forward": "lean"}, "cpus": [3]}
    assert "draft on torch:cpu, lean forward, CPUs 0 1" in summary(proposer)
    assert "target on torch:cpu, lean forward, CPUs 3" in summary(verifier)
    # unpinned: the daemon says None (every CPU of its machine, or a platform that cannot say)
    assert "target on torch:cpu, lean forward" in summary(verifier | {"cpus": None})
