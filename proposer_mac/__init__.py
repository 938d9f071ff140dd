"""Proposer daemon: draft backends, the round driver, the client-facing API."""
