"""The node agent's OpenAI-compatible HTTP API (docs/http-api.md), beside its gRPC service.

`lorafleet-agent serve --http-listen HOST:PORT` runs it in the same process, on the same
`Agent` and engine: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streaming as server-sent events), `GET /health` and `GET /metrics`.

One module per concept: `schema` (the requests, validated by pydantic), `errors` (the OpenAI
error shape and the one status table), `streams` (an `Agent.generate` on a thread, read on the
event loop), `responses` (completion and chat bodies, chunks and logprobs), `json_body` (a body
as JSON, or why not), `routes` (auth, health, models, generation), `connections` (read deadlines
and the connection cap) and `server` (the settings and the event loop's thread).
"""

from node_agent.http_api.server import HttpApiServer, HttpOptions, split_listen

__all__ = ["HttpApiServer", "HttpOptions", "split_listen"]
