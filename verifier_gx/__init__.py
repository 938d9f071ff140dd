"""Verifier daemon: target backends, the round executor, the gRPC servicer."""
