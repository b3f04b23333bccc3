"""`lorafleet-agent`: the node agent's command line (the console script is `node_agent.cli:main`).

`serve` runs the node agent: an engine plus the `lorafleet.v1.NodeAgent` gRPC service (`serve`).
`forward` and `generate` start an engine with the given topology, load adapters, run one batch
and write the logits or the tokens: how users and tests check what an adapter does on a sharded
engine (`batch`). `engine_flags` holds the flags every command shares; `main` the parser and the
exit codes. The names below are the command line's public face.
"""

from node_agent.cli.engine_flags import UsageError, engine_config
from node_agent.cli.main import build_parser, main
from node_agent.cli.serve import agent_config, http_options, server_options, start_servers

__all__ = ["UsageError", "agent_config", "build_parser", "engine_config", "http_options", "main", "server_options", "start_servers"]
