"""The cluster file (`cluster.toml`): schema, loading, key enrolment, refusal rules."""

from cluster_config.schema import ClusterConfig, load_config

__all__ = ["ClusterConfig", "load_config"]
