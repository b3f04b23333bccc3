"""The embedded local default: a tiny random model on a tp=2, dp=2 CPU engine with two adapters.

Run by `scripts/demo.sh`. It shows the engine's promise end to end: adapters load on every rank,
a mixed batch (two adapters and the base model) runs in one forward, and sequences without an
adapter get exactly the base model's output.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

from node_agent.engine import Engine, EngineConfig, SequenceInput, Topology
from node_agent.synthetic import SyntheticModel, write_adapter, write_model

log = logging.getLogger("lorafleet.demo")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    shape = SyntheticModel()
    with tempfile.TemporaryDirectory(prefix="lorafleet-demo-") as tmp:
        root = Path(tmp)
        log.info("writing a tiny random model and two adapters under %s", root)
        model = write_model(root / "model", shape)
        adapters = {"support-bot": write_adapter(root / "a1", shape, rank=8, seed=1),
                    "sql-helper": write_adapter(root / "a2", shape, rank=4, seed=2, targets=("q_proj", "v_proj"))}
        config = EngineConfig(model_dir=model, topology=Topology(tp_size=2, dp_size=2))
        log.info("starting engine: tp=2, dp=2 (two DP-attention groups of one rank each), gloo on CPU")
        with Engine(config) as engine:
            for name, path in adapters.items():
                replies = engine.load_adapter(name, path)
                log.info("loaded %-12s on ranks %s", name, [r.rank for r in replies if r.ok])
            tokens = [1, 5, 9, 42, 7]
            batch = [SequenceInput(tokens, "support-bot"), SequenceInput(tokens, "sql-helper"), SequenceInput(tokens, None)]
            logits = engine.forward(batch)
            base_alone = engine.forward([SequenceInput(tokens, None)])[0]
        for sequence, out in zip(batch, logits):
            log.info("%-12s next token %3d  max|logits - base| = %.4f", sequence.adapter or "(base)",
                     int(out[-1].argmax()), float((out - logits[2]).abs().max()))
        drift = float((logits[2] - base_alone).abs().max())
        log.info("base-only sequence in a mixed batch vs the base model alone: max diff %.2e", drift)
        return 0 if drift <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
