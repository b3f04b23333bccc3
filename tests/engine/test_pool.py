"""The per-rank LoRA pool: LRU, pinning, zeroing, refusals, deterministic decisions."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet_dev.synthetic import SyntheticModel, write_adapter, write_model
from node_agent.engine.adapters.errors import WEIGHTS_FILE
from node_agent.engine.adapters.pool import LoraPool, PoolError
from node_agent.engine.adapters.spec import read_adapter_spec
from node_agent.engine.model.lora_layers import LAYER_CLASSES, LoraCapacity
from node_agent.engine.model_config import ModelConfig
from node_agent.engine.parallel.sharding import DENSE_KINDS, MODULE_KINDS, lora_layout, module_layout
from node_agent.engine.parallel.topology import Topology
from tests.engine.helpers import read_shard

SHAPE = SyntheticModel(num_layers=1)
MAX_RANK = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    cfg = ModelConfig.from_dir(write_model(root / "model", SHAPE))
    adapters = {name: write_adapter(root / name, SHAPE, rank=4, seed=seed) for seed, name in enumerate(["a", "b", "c", "p"])}
    adapters["qv"] = write_adapter(root / "qv", SHAPE, rank=2, seed=9, targets=("q_proj", "v_proj"))
    return cfg, adapters


def make_pool(cfg, adapters, slots: int, max_loaded: int = 8):
    capacity = LoraCapacity(MAX_RANK, slots, fully_sharded=False)
    topology = Topology(1)
    modules = {
        (0, name): LAYER_CLASSES[kind.style](
            module_layout(cfg, topology, 0, name), None, capacity, False, torch.float32, torch.device("cpu")
        )
        for name, kind in ((n, MODULE_KINDS[n]) for n in DENSE_KINDS)
    }
    layouts = {key: module.lora_slices() for key, module in modules.items()}
    shards = {name: read_shard(read_adapter_spec(path, cfg, MAX_RANK), layouts) for name, path in adapters.items()}
    return LoraPool(modules, slots, max_loaded), shards


def test_lru_eviction_and_resident_reuse(setup):
    pool, shards = make_pool(*setup, slots=2)
    for name in "abc":
        pool.add(name, shards[name], pinned=False)
    assert pool.prepare(["a"]) == {"a": 0}
    assert pool.prepare(["b"]) == {"b": 1}
    assert pool.prepare(["c"]) == {"c": 0}, "a was least recently used"
    assert pool.prepare(["b"]) == {"b": 1}, "resident adapters keep their slot"
    assert pool.prepare(["a"]) == {"a": 0}, "c is now least recently used"
    assert pool.resident() == {0: "a", 1: "b"}


def test_adapters_of_the_batch_are_never_evicted_and_overflow_is_refused(setup):
    pool, shards = make_pool(*setup, slots=2)
    for name in "abc":
        pool.add(name, shards[name], pinned=False)
    assert pool.prepare(["a", "b"]) == {"a": 0, "b": 1}
    with pytest.raises(PoolError, match="no free LoRA slot"):
        pool.prepare(["a", "b", "c"])
    assert pool.resident() == {0: "a", 1: "b"}, "a refused batch changes nothing"
    assert pool.prepare(["c", "b"]) == {"c": 0, "b": 1}, "a (not in batch) is evicted, b kept"


def test_pinned_adapters_stay_resident_and_base_batches_never_need_a_slot(setup):
    pool, shards = make_pool(*setup, slots=2)
    pool.add("p", shards["p"], pinned=True)
    assert pool.resident() == {0: "p"}, "a pinned adapter is resident at once"
    for name in "ab":
        pool.add(name, shards[name], pinned=False)
    assert pool.prepare(["a"]) == {"a": 1}
    assert pool.prepare(["b"]) == {"b": 1}, "the unpinned adapter is evicted, never the pinned one"
    assert pool.prepare(["p", "a"]) == {"p": 0, "a": 1}
    with pytest.raises(PoolError, match="1 pinned"):
        pool.prepare(["a", "b"])
    assert pool.prepare([]) == {}, "base-only batches take no slot"


def test_pinning_more_adapters_than_slots_is_refused(setup):
    pool, shards = make_pool(*setup, slots=1)
    pool.add("p", shards["p"], pinned=True)
    with pytest.raises(PoolError, match="cannot pin 'a'"):
        pool.add("a", shards["a"], pinned=True)
    assert "a" not in pool.adapters
    pool.add("b", shards["b"], pinned=False)
    with pytest.raises(PoolError, match="no free LoRA slot"):
        pool.prepare(["b"])


def test_max_loaded_and_unknown_names(setup):
    pool, shards = make_pool(*setup, slots=2, max_loaded=2)
    pool.add("a", shards["a"], pinned=False)
    pool.add("b", shards["b"], pinned=False)
    with pytest.raises(PoolError, match="max_loaded_loras"):
        pool.add("c", shards["c"], pinned=False)
    with pytest.raises(PoolError, match="already loaded"):
        pool.add("a", shards["a"], pinned=False)
    with pytest.raises(PoolError, match="'zzz' is not loaded"):
        pool.prepare(["zzz"])
    with pytest.raises(PoolError, match="not loaded"):
        pool.remove("zzz")


def test_eviction_and_removal_zero_every_module_of_the_slot(setup):
    pool, shards = make_pool(*setup, slots=1)
    pool.add("a", shards["a"], pinned=False)
    pool.add("qv", shards["qv"], pinned=False)
    pool.prepare(["a"])
    assert all(module.a_stacks[0][0].any() for module in pool.modules.values())
    pool.prepare(["qv"])  # evicts "a" from the only slot
    qkv = pool.modules[(0, "qkv_proj")]
    assert qkv.b_stacks[0][0].any() and qkv.b_stacks[2][0].any(), "q and v slices hold qv's weights"
    assert not qkv.a_stacks[1][0].any() and not qkv.b_stacks[1][0].any(), "k slice inherited nothing"
    assert qkv.scales[1, 0] == 0
    for key in [(0, "o_proj"), (0, "gate_up_proj"), (0, "down_proj")]:
        module = pool.modules[key]
        assert not any(a[0].any() for a in module.a_stacks), key
        assert not any(b[0].any() for b in module.b_stacks), key
    pool.remove("qv")
    assert pool.resident() == {}
    for module in pool.modules.values():
        assert not any(t[0].any() for t in (*module.a_stacks, *module.b_stacks)) and not module.scales.any()


def test_identical_operations_give_identical_decisions(setup):
    """Two pools (two ranks) fed the same operations decide the same slots, whatever the names."""
    sequence = [["c"], ["a", "b"], ["c"], ["b"], ["a", "c"], [], ["b", "a"]]
    results = []
    for _ in range(2):
        pool, shards = make_pool(*setup, slots=2)
        for name in "cab":
            pool.add(name, shards[name], pinned=False)
        results.append([pool.prepare(batch) for batch in sequence])
    assert results[0] == results[1]


FILE_AND_ENGINE_DTYPES = [
    (torch.bfloat16, torch.bfloat16),  # moved as 16-bit integers (numpy has no bfloat16)
    (torch.float16, torch.float16),
    (torch.float64, torch.float64),
    (torch.float16, torch.float32),  # converted by torch
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize(("file_dtype", "engine_dtype"), FILE_AND_ENGINE_DTYPES, ids=lambda d: str(d).split(".")[1])
def test_shards_hold_the_files_values_in_every_dtype(setup, tmp_path, file_dtype, engine_dtype):
    """A rank's shard, for every pair of file and engine dtype, holds exactly the file's values:
    the column slices of row-parallel A (read through a staging buffer) as well as whole rows.
    The values are multiples of 1/256 below 1, exact in every float dtype, so each shard upcast
    to fp32 equals the shard of the same adapter written in fp32."""
    cfg, adapters = setup
    generator = torch.Generator().manual_seed(3)
    tensors = {
        key: (torch.randint(-200, 200, tensor.shape, generator=generator) / 256)
        for key, tensor in load_file(adapters["a"] / WEIGHTS_FILE).items()
    }
    paths = {}
    for dtype in (torch.float32, file_dtype):
        path = tmp_path / str(dtype).split(".")[1]
        shutil.copytree(adapters["a"], path, dirs_exist_ok=True)
        save_file({key: value.to(dtype) for key, value in tensors.items()}, str(path / WEIGHTS_FILE))
        paths[dtype] = path
    topology = Topology(4)
    for rank in range(topology.tp_size):
        layouts = {(0, kind): lora_layout(module_layout(cfg, topology, rank, kind), MAX_RANK, False) for kind in DENSE_KINDS}
        reference = read_shard(read_adapter_spec(paths[torch.float32], cfg, MAX_RANK), layouts)
        shard = read_shard(read_adapter_spec(paths[file_dtype], cfg, MAX_RANK), layouts, engine_dtype)
        assert reference.weights.keys() == shard.weights.keys()
        for key, parts in reference.weights.items():
            for want, got in zip(parts, shard.weights[key], strict=True):
                assert want is not None and got is not None
                assert got.a.dtype == got.b.dtype == engine_dtype
                assert torch.equal(got.a.float(), want.a) and torch.equal(got.b.float(), want.b), (rank, key)
                assert want.a.any() and want.b.any(), (rank, key)
