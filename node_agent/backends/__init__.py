"""Backends over stock inference servers: one agent drives several servers over HTTP, each a rank
of the seam's per-rank replies. `servers_backend` is the part every server kind shares (all or
nothing, holdings, routing); `vllm` is vLLM's client (docs/vllm.md says how SGLang's fits)."""
