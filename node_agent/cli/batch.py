"""`lorafleet-agent forward` and `generate`: one batch straight through an engine.

`forward` loads adapters, runs one batch and writes the logits; `generate` submits every request
at once to the scheduler and writes the tokens. Both are how users and tests check what an
adapter does on a sharded engine, after the agent's own request checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from node_agent.cli.engine_flags import UsageError, add_engine_arguments, engine_config
from node_agent.engine import MAX_LOGPROBS, Engine, EngineConfig, GeneratedStep, SamplingParams, SequenceInput, TokenLogprobs
from node_agent.validation import check_adapter_name, check_forward
from node_agent.values import DEFAULT_NEW_TOKENS

log = logging.getLogger("lorafleet.agent")


def parse_adapter(value: str) -> tuple[str, Path]:
    """An --adapter value, NAME=DIR, as (name, directory)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {value!r}")
    return name, Path(path)


def read_sequences(path: Path) -> list[SequenceInput]:
    """IN.json: a JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}."""
    return [SequenceInput(tokens=item["tokens"], adapter=adapter) for item, adapter in read_input_items(path, "sequence")]


def read_input_items(path: Path, what: str) -> list[tuple[dict[str, Any], str | None]]:
    """The items of an IN.json list (`what`: "sequence" or "request"), each an object with a
    'tokens' list, with its 'adapter' (a name or null); every refusal names the item."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise UsageError(f"input file {path} not found") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"input file {path} is not valid JSON: {error}") from error
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"input file {path} must hold a non-empty JSON list of {what}s")
    items = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("tokens"), list):
            raise UsageError(f"input {what} {index} must be an object with a 'tokens' list")
        adapter = item.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise UsageError(f"input {what} {index}: 'adapter' must be a name or null")
        items.append((item, adapter))
    return items


def adapter_names(args: argparse.Namespace) -> list[str]:
    """The --adapter names, each given once and each a valid adapter name."""
    names = [name for name, _ in args.adapter]
    if len(set(names)) != len(names):
        raise UsageError("each --adapter NAME may be given once")
    for name in names:
        check_adapter_name(name)
    return names


def load_adapters(engine: Engine, adapters: list[tuple[str, Path]]) -> None:
    """Load each --adapter NAME=DIR into the engine, in order."""
    for name, path in adapters:
        log.info("loading adapter %s from %s", name, path)
        engine.load_adapter(name, path)


def run_forward(args: argparse.Namespace) -> None:
    """`forward`: load the adapters, run one batch, write the logits to OUT.safetensors."""
    from safetensors.torch import save_file

    sequences = read_sequences(args.input)
    adapter_names(args)  # refused before any rank starts
    with Engine(engine_config(args)) as engine:
        # The agent's own checks of a Forward: the engine trusts what it is given.
        check_forward([s.tokens for s in sequences], engine.model_config.vocab_size)
        load_adapters(engine, args.adapter)
        logits = engine.forward(sequences)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"logits.{i}": t.contiguous() for i, t in enumerate(logits)}, str(args.output))
    log.info("wrote %d logits tensors to %s", len(logits), args.output)


_REQUEST_FIELDS = {"tokens", "adapter", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "logprobs"}


def read_generate_requests(path: Path, logprobs: int | None = None) -> list[tuple[list[int], str | None, SamplingParams]]:
    """IN.json of `generate`: a JSON list of {"tokens": [...], "adapter": NAME or null,
    "max_tokens": N, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null,
    "stop_token_ids": [], "logprobs": N or null} (only "tokens" required; a request without
    "logprobs" takes `logprobs`, the --logprobs flag)."""
    requests = []
    for index, (item, adapter) in enumerate(read_input_items(path, "request")):
        unknown = sorted(set(item) - _REQUEST_FIELDS)
        if unknown:
            raise UsageError(f"input request {index}: unknown field {unknown[0]!r}")
        stop = item.get("stop_token_ids", [])
        if not isinstance(stop, list):
            raise UsageError(f"input request {index}: 'stop_token_ids' must be a list of token ids")
        try:
            params = SamplingParams(
                temperature=item.get("temperature", 0.0),
                top_p=item.get("top_p", 1.0),
                top_k=item.get("top_k", 0),
                min_p=item.get("min_p", 0.0),
                seed=item.get("seed"),
                max_tokens=item.get("max_tokens", DEFAULT_NEW_TOKENS),
                stop_token_ids=tuple(stop),
                logprobs=item.get("logprobs", logprobs),
            )
        except (TypeError, ValueError) as error:
            raise UsageError(f"input request {index}: {error}") from error
        requests.append((item["tokens"], adapter, params))
    return requests


def generation_output(steps: list[GeneratedStep]) -> dict[str, Any]:
    """One OUT.json entry: the generated ids and the finish reason, and, when the request asked
    for logprobs, one entry per token as OpenAI's chat API lays them out (token ids, not text)."""
    finish = steps[-1].finish
    out: dict[str, Any] = {"tokens": [step.token_id for step in steps], "finish_reason": finish.value if finish else None}
    if steps[0].logprobs is not None:
        out["logprobs"] = [token_logprobs(step.token_id, step.logprobs) for step in steps if step.logprobs is not None]
    return out


def token_logprobs(token_id: int, logprobs: TokenLogprobs) -> dict[str, Any]:
    """{"token": id, "logprob": x, "top_logprobs": [{"token": id, "logprob": x}, ...]}, highest first."""
    top = [{"token": t, "logprob": lp} for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs, strict=True)]
    return {"token": token_id, "logprob": logprobs.logprob, "top_logprobs": top}


def run_generate(args: argparse.Namespace) -> None:
    """`generate`: load the adapters, submit every request at once, write the tokens to OUT.json."""
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise UsageError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    requests = read_generate_requests(args.input, args.logprobs)
    names = adapter_names(args)
    unknown = sorted({adapter for _, adapter, _ in requests if adapter is not None} - set(names))
    if unknown:
        raise UsageError(f"an input request names adapter {unknown[0]!r}, which no --adapter gives")
    config = dataclasses.replace(engine_config(args), max_waiting=max(EngineConfig.max_waiting, len(requests)))
    with Engine(config) as engine:
        check_forward([tokens for tokens, _, _ in requests], engine.model_config.vocab_size)
        load_adapters(engine, args.adapter)
        # Every request at once: the scheduler batches them.
        generations = [engine.submit(tokens, adapter, params) for tokens, adapter, params in requests]
        results = [generation_output(list(generation.tokens())) for generation in generations]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results) + "\n")
    log.info("wrote %d generations to %s", len(results), args.output)


def add_forward_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `forward` command, its flags and its help."""
    forward = commands.add_parser(
        "forward",
        help="run one batch through a sharded engine and write the logits",
        description="Start an engine with the given topology on this machine, load the adapters, run one "
        "forward over all input sequences together (spread over the DP groups) and write float32 "
        "tensors logits.0, logits.1, ... of shape [len(tokens), vocab_size] to OUT.safetensors.",
    )
    add_engine_arguments(forward)
    add_adapter_argument(forward)
    forward.add_argument(
        "--input", required=True, type=Path, metavar="IN.json", help='JSON list of {"tokens": [int, ...], "adapter": "NAME" or null}'
    )
    forward.add_argument("--output", required=True, type=Path, metavar="OUT.safetensors", help="where to write the logits")
    forward.set_defaults(run=run_forward)


def add_generate_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `generate` command, its flags and its help."""
    generate = commands.add_parser(
        "generate",
        help="generate for a batch of requests through the engine's scheduler and write the tokens",
        description="Start an engine with the given topology on this machine, load the adapters, submit every "
        "input request at once to the scheduler (continuous batching over the DP groups) and write, in input "
        'order, [{"tokens": [generated ids], "finish_reason": "stop" | "length"}, ...] to OUT.json. Only the '
        "request's own stop_token_ids stop it (the model's EOS is not added). A request with logprobs N also gets "
        '"logprobs": one {"token": id, "logprob": x, "top_logprobs": [{"token": id, "logprob": x}, ...]} per generated '
        "token: the log-softmax of the model's logits before temperature and filtering, the N most likely tokens "
        "highest first (lower id first on ties).",
    )
    add_engine_arguments(generate)
    add_adapter_argument(generate)
    generate.add_argument(
        "--input",
        required=True,
        type=Path,
        metavar="IN.json",
        help='JSON list of {"tokens": [...], "adapter": NAME or null, "max_tokens": N, "temperature": 0.0, '
        '"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": null, "stop_token_ids": [], "logprobs": null} '
        "(only tokens required)",
    )
    generate.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help=f"per generated token, its logprob and the N (0-{MAX_LOGPROBS}) most likely tokens' in OUT.json, "
        'for every request without its own "logprobs" (default: none)',
    )
    generate.add_argument("--output", required=True, type=Path, metavar="OUT.json", help="where to write the generations")
    generate.set_defaults(run=run_generate)


def add_adapter_argument(parser: argparse.ArgumentParser) -> None:
    """--adapter NAME=DIR, repeatable: the adapters a batch command loads before its batch."""
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        type=parse_adapter,
        metavar="NAME=DIR",
        help="a PEFT adapter directory to load under NAME (repeatable)",
    )
