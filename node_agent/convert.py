"""Conversions between `lorafleet.v1` messages and the agent's domain values (no logic)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from lorafleet.v1 import agent_pb2 as pb
from lorafleet_common.registry import RegistryEntry
from node_agent.adapter_stats import AdapterStatsSnapshot
from node_agent.engine import ControlResult
from node_agent.errors import InvalidRequest
from node_agent.sources import Credential, DownloadProgress, S3Credential, SourceCredential
from node_agent.values import AfterLoad, Description, GeneratedToken, GenerateParams


def source_credential(request: pb.LoadAdapterRequest | pb.ResolveSourceRequest) -> Credential | None:
    """A load's (or a resolution's) source credential: its bearer token, its basic user and
    password, or its S3 access key (one of them)."""
    if sum((bool(request.source_token), request.HasField("source_basic"), request.HasField("source_s3"))) > 1:
        raise InvalidRequest("a load carries one of source_token, source_basic and source_s3, not several")
    if request.HasField("source_s3"):
        s3 = request.source_s3
        return S3Credential(s3.access_key_id, s3.secret_access_key, s3.session_token)
    if request.HasField("source_basic"):
        return SourceCredential.basic(request.source_basic.username, request.source_basic.password)
    return SourceCredential.bearer(request.source_token) if request.source_token else None


def description(d: Description) -> pb.DescribeResponse:
    """Describe's reply."""
    return pb.DescribeResponse(
        agent_id=d.agent_id,
        base_model=pb.BaseModel(name=d.base_model_name, config_sha256=d.config_sha256),
        topology=pb.Topology(
            tp_size=d.topology.tp_size,
            dp_size=d.topology.dp_size,
            attn_tp_size=d.topology.attn_tp_size,
            fully_sharded_loras=d.topology.fully_sharded_loras,
            ep_size=d.topology.ep_size,
            moe_tp_size=d.topology.moe_tp_size,
        ),
        capacity=pb.Capacity(max_lora_rank=d.max_lora_rank, max_loras_per_batch=d.max_loras_per_batch, max_loaded_loras=d.max_loaded_loras),
        ranks=[pb.RankInfo(rank=r.rank, attn_dp_rank=r.attn_dp_rank, attn_tp_rank=r.attn_tp_rank, alive=r.alive) for r in d.ranks],
        modules=[
            pb.ModuleShapes(
                module=m.module,
                rank=m.rank,
                slices=[pb.LoraSliceShape(lora_a_shape=s.lora_a, lora_b_shape=s.lora_b) for s in m.slices],
            )
            for m in d.modules
        ],
        has_tokenizer=d.has_tokenizer,
        backend=pb.BackendInfo(kind=d.backend.kind, version=d.backend.version, endpoints=d.backend.endpoints),
    )


def _rank_results(result: ControlResult) -> list[pb.RankResult]:
    return [
        pb.RankResult(
            rank=o.rank,
            attn_dp_rank=o.attn_dp_rank,
            attn_tp_rank=o.attn_tp_rank,
            success=o.ok,
            error_message=o.error,
            weights_sha256=o.digests.weights_sha256 if o.digests else "",
            config_sha256=o.digests.config_sha256 if o.digests else "",
            transient=o.transient,
        )
        for o in result.ranks
    ]


#: A load reply's residency by `AfterLoad.standby` (None: no successful load to say it of).
_LOAD_RESIDENCY = {
    None: pb.ADAPTER_RESIDENCY_UNSPECIFIED,
    False: pb.ADAPTER_RESIDENCY_RESIDENT,
    True: pb.ADAPTER_RESIDENCY_STANDBY,
}


def load_response(result: ControlResult, with_holdings: bool = True, after: AfterLoad | None = None) -> pb.LoadAdapterResponse:
    """LoadAdapter's reply: the merged result, what the ranks hold (unless a LoadAdapters call
    lists that once for all its loads: `with_holdings` False), every rank's part, and what the
    load left (`after`: its source's revision, resident or standby)."""
    after = after or AfterLoad()
    return pb.LoadAdapterResponse(
        success=result.ok,
        error_message=result.error,
        loaded_adapters=result.holds if with_holdings else (),
        rank_results=_rank_results(result),
        already_loaded=result.already_loaded,
        transient=result.transient,
        source_revision=after.revision,
        residency=_LOAD_RESIDENCY[after.standby],
    )


def unload_response(result: ControlResult) -> pb.UnloadAdapterResponse:
    """UnloadAdapter's reply: the merged result, what the ranks hold, every rank's part."""
    return pb.UnloadAdapterResponse(
        success=result.ok,
        error_message=result.error,
        loaded_adapters=result.holds,
        rank_results=_rank_results(result),
        transient=result.transient,
    )


def list_response(adapters: list[RegistryEntry], downloading: Mapping[str, DownloadProgress]) -> pb.ListAdaptersResponse:
    """ListAdapters' reply: the registry, and the loads whose source is downloading now."""
    progress = {name: p.snapshot() for name, p in list(downloading.items())}
    return pb.ListAdaptersResponse(
        adapters=[
            pb.AdapterInfo(name=a.name, source_uri=a.source_uri, sha256=a.sha256, pinned=a.pinned, ranks=a.ranks, residency=_residency(a))
            for a in adapters
        ],
        downloading=[pb.DownloadProgress(name=name, bytes_done=done, bytes_total=total) for name, (done, total) in progress.items()],
    )


def _residency(entry: RegistryEntry) -> pb.AdapterResidency:
    return pb.ADAPTER_RESIDENCY_STANDBY if entry.standby else pb.ADAPTER_RESIDENCY_RESIDENT


def adapter_stats_response(snapshot: AdapterStatsSnapshot) -> pb.AdapterStatsResponse:
    """AdapterStats' reply."""
    return pb.AdapterStatsResponse(
        taken_at_unix_s=snapshot.taken_at_unix_s,
        window_s=snapshot.window_s,
        adapters=[
            pb.AdapterStat(
                adapter=stat.adapter,
                running=stat.running,
                waiting=stat.waiting,
                generated_tokens=stat.generated_tokens,
                tokens_per_s=stat.tokens_per_s,
                ttft_count=stat.ttft_count,
                ttft_mean_s=stat.ttft_mean_s,
                ttft_p50_s=stat.ttft_p50_s,
            )
            for stat in snapshot.adapters
        ],
    )


def forward_sequences(request: pb.ForwardRequest) -> list[tuple[list[int], str | None]]:
    """A Forward request's sequences as (token ids, adapter or None for the base model)."""
    return [(list(s.token_ids), s.adapter or None) for s in request.sequences]


def forward_response(logits: list[np.ndarray]) -> pb.ForwardResponse:
    """Forward's reply: each sequence's logits as little-endian float32 bytes."""
    return pb.ForwardResponse(
        logits=[
            pb.Logits(num_tokens=a.shape[0], vocab_size=a.shape[1], float32_data=np.ascontiguousarray(a, dtype="<f4").tobytes())
            for a in logits
        ]
    )


def generate_params(request: pb.GenerateRequest) -> GenerateParams:
    """A Generate request's parameters ("" adapter: the base model)."""
    return GenerateParams(
        token_ids=tuple(request.token_ids),
        prompt=request.prompt,
        adapter=request.adapter or None,
        max_new_tokens=request.max_new_tokens,
        stop_token_ids=tuple(request.stop_token_ids),
        temperature=request.temperature,
        top_p=request.top_p or 1.0,  # proto3's unset 0 means off
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed if request.HasField("seed") else None,
        logprobs=request.logprobs if request.HasField("logprobs") else None,
        stop=tuple(request.stop),
    )


def generated(token: GeneratedToken) -> pb.GenerateResponse:
    """One streamed Generate message."""
    response = pb.GenerateResponse(
        token_id=token.token_id,
        text=token.text,
        finish_reason=token.finish_reason,
        finish=_FINISH[token.finish_reason],
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in token.top_logprobs],
    )
    if token.logprob is not None:
        response.logprob = token.logprob
    if token.usage is not None:
        response.usage.prompt_tokens, response.usage.completion_tokens = token.usage
    return response


_FINISH = {"": pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
