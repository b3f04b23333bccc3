"""Test support, one module per concept.

* :mod:`tests.support.models` — tiny random HF models and PEFT-written adapters;
* :mod:`tests.support.oracle` — transformers + PEFT logits (and an independent hand merge);
* :mod:`tests.support.bad_adapters` — the adapters the engine must refuse (`BAD_ADAPTERS`);
* :mod:`tests.support.open_watcher` — proof (inotify) that a file was never opened;
* the PEFT file-format names (`ADAPTER_CONFIG`, `ALL_MODULES`, `lora_key`, ...) come from
  :mod:`lorafleet_dev.synthetic`, which writes files of that format without transformers.

The package re-exports what the engine tests use, so ``from tests import support as R`` gives
them one name for it.
"""

from lorafleet_dev.synthetic import ALL_MODULES
from tests.support.bad_adapters import BAD_ADAPTERS, make_adapter_with_pickle_decoys, make_dora_adapter
from tests.support.models import make_adapter, make_per_expert_adapter, make_tiny_model, model_config
from tests.support.open_watcher import FileOpenWatcher
from tests.support.oracle import reference_logits

__all__ = [
    "ALL_MODULES",
    "BAD_ADAPTERS",
    "FileOpenWatcher",
    "make_adapter",
    "make_adapter_with_pickle_decoys",
    "make_dora_adapter",
    "make_per_expert_adapter",
    "make_tiny_model",
    "model_config",
    "reference_logits",
]
