"""The cluster file (`cluster.toml`): schema, loading, key enrolment, TLS, refusal rules."""

from cluster_config.schema import ClusterConfig, ConfigError, Tls, load_config

__all__ = ["ClusterConfig", "ConfigError", "Tls", "load_config"]
