"""Stock vLLM's half of `bench_vs_vllm.py`: run under the python of vLLM's own environment
(`scripts/build-vllm.sh`), never imported by the project (it needs vLLM's torch).

It builds vLLM's offline engine (`LLM`, its `LLMEngine` stepped by hand, so each token's arrival
is seen as a user of the engine sees it) over the model and adapters named on the command line,
then answers one workload per line of stdin: a JSON list of requests `[tokens, adapter or null,
max_tokens]`, all submitted at once; for each it prints one line `RESULT <json>`: per request,
its submission time and each token's arrival time (perf_counter seconds).

Run by `bench_vs_vllm.py`; by hand: `python benchmarks/vllm_side.py MODEL_DIR DTYPE ADAPTER_DIR...`.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    model, dtype, *adapter_dirs = sys.argv[1:]
    llm = LLM(
        model=model,
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=256,
        enable_lora=True,
        max_loras=len(adapter_dirs),
        max_cpu_loras=len(adapter_dirs),
        max_lora_rank=16,
        max_num_seqs=64,
        kv_cache_memory_bytes=256 << 20,
    )
    engine = llm.llm_engine
    adapters = {f"a{i}": LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapter_dirs)}
    serial = 0
    print("READY", flush=True)
    for line in sys.stdin:
        requests = json.loads(line)
        submitted: list[float] = []
        times: list[list[float]] = []
        index: dict[str, int] = {}  # outputs name a request by the id it was given
        for tokens, adapter, max_tokens in requests:
            serial += 1
            params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
            index[f"r{serial}"] = len(times)
            submitted.append(time.perf_counter())
            times.append([])
            engine.add_request(f"r{serial}", {"prompt_token_ids": tokens}, params, lora_request=adapters.get(adapter))
        while engine.has_unfinished_requests():
            for output in engine.step():
                now, arrived = time.perf_counter(), times[index[output.request_id]]
                arrived.extend([now] * (len(output.outputs[0].token_ids) - len(arrived)))
        print("RESULT " + json.dumps([[s, t] for s, t in zip(submitted, times, strict=True)]), flush=True)


if __name__ == "__main__":
    main()
