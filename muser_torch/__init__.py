"""The torch model runner both daemons load (docs/architecture.md): the torch target backend
and the torch draft are one implementation, so they cannot drift. `backend` holds
`TorchBackend` (one KV, forward selection, capture hooks), `batched` the per-sequence KV and
ragged batches, `llama_forward` the lean Llama forward. It imports only the core."""
