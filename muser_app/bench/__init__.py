"""`muser bench` (docs/design.md §10): the lanes and peers measured on one pair (`run`), the cluster
it starts for its cluster lanes (`cluster`), the sessions suite (`sessions`), the vLLM peer's
child process (`vllm_peer`) and the sample every lane returns (`sample`)."""
