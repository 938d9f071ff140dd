"""Real qualification receipts for test clusters, at the cost of one qualification per lane.

Integration tests create dozens of clusters, each with fresh verifier keys; qualifying each
for real would cost ~5-10 s of CPU apiece. What a qualification measures (the evidence)
depends only on the binding: both models' digests, the lane params and the software version.
So the first cluster of a binding is qualified for real, through the same `qualify` the CLI
runs (on 1 fixture prompt x 256 tokens, the least the policy accepts, to keep the suite
short), and every later cluster of that binding gets that evidence signed with its own
verifier key by the same `sign` the CLI uses. The cache lives for one test process: the
default suite qualifies twice (D=4 for most clusters, D=2 for the crash tests).
"""

from __future__ import annotations

from cluster_config import ClusterConfig
from cluster_config import qualification as q

PROMPTS = 1
_EVIDENCE: dict[bytes, q.Evidence] = {}


def qualified_receipt(config: ClusterConfig) -> q.Receipt:
    """Write a receipt qualifying `config`'s lane to lane.receipt, signed by its verifier."""
    from muser import keys
    from muser_app.cli.qualify import qualify
    from muser_app.fixtures import natural_prompts

    binding = q.binding_of(config)
    evidence = _EVIDENCE.get(binding.key())
    if evidence is None:
        receipt = qualify(config, natural_prompts(PROMPTS), progress=False)
        _EVIDENCE[binding.key()] = receipt.evidence
        return receipt
    receipt = q.sign(binding, evidence, keys.load_private(config.verifier.key))
    q.write_receipt(config.lane.receipt, receipt)
    return receipt
