"""`lorafleet-agent`'s parser (its commands in their order) and `main`: logging and exit codes."""

from __future__ import annotations

import argparse
import logging
import sys

from node_agent.cli.batch import add_forward_command, add_generate_command
from node_agent.cli.engine_flags import UsageError
from node_agent.cli.serve import add_serve_command
from node_agent.engine import AdapterLoadError, EngineError, SchedulerError
from node_agent.errors import InvalidRequest


def build_parser() -> argparse.ArgumentParser:
    """`lorafleet-agent` with its commands: forward, generate, serve."""
    parser = argparse.ArgumentParser(prog="lorafleet-agent", description="lorafleet node agent: sharded multi-LoRA engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)
    add_forward_command(commands)
    add_generate_command(commands)
    add_serve_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit code 0, 1 (the command failed) or 2 (bad command-line input)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        args.run(args)
    except (UsageError, InvalidRequest, EngineError, SchedulerError, AdapterLoadError, ValueError, OSError) as error:
        print(f"lorafleet-agent: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    return 0
