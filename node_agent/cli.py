"""`lorafleet-agent`: the node agent's command line.

`forward` starts an engine with the given topology, loads adapters, runs one batch and writes
the logits: how users and tests check what an adapter does on a sharded engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from node_agent.engine import AdapterLoadError, Engine, EngineConfig, EngineError, SequenceInput, Topology

log = logging.getLogger("lorafleet.agent")


class UsageError(ValueError):
    """Bad command-line input (reported as one line, exit code 2)."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that starts an engine."""
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks in the engine (default 1)")
    parser.add_argument("--dp", type=int, default=1, help="DP-attention groups; must divide --tp (default 1)")
    parser.add_argument("--fully-sharded-loras", action="store_true", help="S-LoRA mode: shard LoRA A/B on the rank dim too")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    parser.add_argument("--max-loras-per-batch", type=int, default=4, help="device LoRA slots per rank (default 4)")
    parser.add_argument("--max-loaded-loras", type=int, default=32, help="adapters kept loaded on the host (default 32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where ranks run (default cpu, gloo)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--master-port", type=int, default=0, help="torch.distributed port on 127.0.0.1 (default: a free one)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_dir=args.model,
        topology=Topology(tp_size=args.tp, dp_size=args.dp, fully_sharded_loras=args.fully_sharded_loras),
        max_lora_rank=args.max_lora_rank,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        device=args.device,
        dtype=args.dtype,
        master_port=args.master_port,
    )


def parse_adapter(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, Path(path)


def read_sequences(path: Path) -> list[SequenceInput]:
    """IN.json: a JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise UsageError(f"input file {path} not found") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"input file {path} is not valid JSON: {error}") from error
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"input file {path} must hold a non-empty JSON list of sequences")
    sequences = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("tokens"), list):
            raise UsageError(f"input sequence {index} must be an object with a 'tokens' list")
        adapter = item.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise UsageError(f"input sequence {index}: 'adapter' must be a name or null")
        sequences.append(SequenceInput(tokens=item["tokens"], adapter=adapter))
    return sequences


def run_forward(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    sequences = read_sequences(args.input)
    names = [name for name, _ in args.adapter]
    if len(set(names)) != len(names):
        raise UsageError("each --adapter NAME may be given once")
    with Engine(engine_config(args)) as engine:
        for name, path in args.adapter:
            log.info("loading adapter %s from %s", name, path)
            engine.load_adapter(name, path)
        logits = engine.forward(sequences)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"logits.{i}": t.contiguous() for i, t in enumerate(logits)}, str(args.output))
    log.info("wrote %d logits tensors to %s", len(logits), args.output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lorafleet-agent", description="lorafleet node agent: sharded multi-LoRA engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)
    forward = commands.add_parser(
        "forward",
        help="run one batch through a sharded engine and write the logits",
        description="Start an engine with the given topology on this machine, load the adapters, run one "
        "forward over all input sequences together (spread over the DP groups) and write float32 "
        "tensors logits.0, logits.1, ... of shape [len(tokens), vocab_size] to OUT.safetensors.",
    )
    add_engine_arguments(forward)
    forward.add_argument("--adapter", action="append", default=[], type=parse_adapter, metavar="NAME=DIR",
                         help="a PEFT adapter directory to load under NAME (repeatable)")
    forward.add_argument("--input", required=True, type=Path, metavar="IN.json",
                         help='JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}')
    forward.add_argument("--output", required=True, type=Path, metavar="OUT.safetensors", help="where to write the logits")
    forward.set_defaults(run=run_forward)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        args.run(args)
    except (UsageError, EngineError, AdapterLoadError, ValueError, OSError) as error:
        print(f"lorafleet-agent: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
