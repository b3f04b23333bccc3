"""Demand per adapter as the agent measures it (the AdapterStats call, docs/agent.md).

The backend counts each adapter's running and waiting requests (`Backend.adapter_requests`);
what the agent's own generation path sees is recorded here, in one place, for every backend
alike: the tokens each adapter's Generate requests streamed, and each request's time to first
token (from the moment the agent took the admitted request to its first token). Both are kept
for a sliding window (`WINDOW_S`): tokens in one bucket per whole second, times to first token
as the window's most recent samples (at most `MAX_TTFT_SAMPLES` per adapter), so memory stays
bounded whatever the traffic. Names are public names; the base model is "". The same
measures feed the per-adapter Prometheus metrics (`node_agent.adapter_metrics`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from node_agent.adapter_metrics import AdapterRequestMetrics

#: The window the rates and times to first token cover, in seconds.
WINDOW_S = 60.0
#: The most recent times to first token kept per adapter (the window's, at most this many).
MAX_TTFT_SAMPLES = 1024


@dataclass(frozen=True)
class RequestCounts:
    """An adapter's requests in the backend now."""

    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class AdapterStat:
    """One adapter's demand ("" the base model): requests now, tokens and times to first token
    over the window."""

    adapter: str
    running: int
    waiting: int
    generated_tokens: int  # within the window
    tokens_per_s: float  # generated_tokens / window_s
    ttft_count: int  # first tokens within the window
    ttft_mean_s: float  # 0 when ttft_count is 0
    ttft_p50_s: float


@dataclass(frozen=True)
class AdapterStatsSnapshot:
    """Every adapter's demand at one moment (`taken_at_unix_s`, seconds since the epoch)."""

    taken_at_unix_s: float
    window_s: float
    adapters: tuple[AdapterStat, ...]


@dataclass
class _Recent:
    """One adapter's window: tokens per whole second, and (time, seconds) of first tokens."""

    tokens: deque[list[int]] = field(default_factory=deque)  # [second, count], oldest first
    ttfts: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_TTFT_SAMPLES))

    def trim(self, since: float) -> None:
        while self.tokens and self.tokens[0][0] < since:
            self.tokens.popleft()
        while self.ttfts and self.ttfts[0][0] < since:
            self.ttfts.popleft()


class RequestMeasure:
    """One Generate request's measure: `token()` for each token it streams."""

    def __init__(self, recorder: DemandRecorder, adapter: str, prompt_tokens: int) -> None:
        self._recorder = recorder
        self._adapter = adapter
        self._prompt_tokens = prompt_tokens
        self._started = recorder.clock()
        self._last: float | None = None  # the previous token's time
        self._label = ""  # the per-adapter metrics' label, once the first token chose it

    def token(self) -> None:
        """One more token streamed; the first one's time since the start is its time to first
        token, each later one's since the one before its inter-token latency."""
        now = self._recorder.clock()
        metrics = self._recorder.metrics
        if self._last is None:
            self._recorder.record(self._adapter, now, now - self._started)
            if metrics is not None:
                self._label = metrics.label(self._adapter)
                metrics.first_token(self._label, self._prompt_tokens, now - self._started)
        else:
            self._recorder.record(self._adapter, now, None)
            if metrics is not None:
                metrics.next_token(self._label, now - self._last)
        self._last = now


class DemandRecorder:
    """Tokens and times to first token per adapter over the last `window_s` seconds, and the
    per-adapter request metrics (`metrics`, when given); safe to use from many threads at once."""

    def __init__(
        self, metrics: AdapterRequestMetrics | None = None, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics = metrics
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, _Recent] = {}

    def request(self, adapter: str | None, prompt_tokens: int = 0) -> RequestMeasure:
        """Start measuring a Generate request of `adapter` (None: the base model) with
        `prompt_tokens` tokens of prompt now."""
        return RequestMeasure(self, adapter or "", prompt_tokens)

    def record(self, adapter: str, now: float, ttft_s: float | None) -> None:
        """One token of `adapter` at `now` (monotonic), with its request's time to first token
        when it is the first."""
        second = int(now)
        with self._lock:
            recent = self._recent.setdefault(adapter, _Recent())
            if recent.tokens and recent.tokens[-1][0] == second:
                recent.tokens[-1][1] += 1
            else:
                recent.tokens.append([second, 1])
            if ttft_s is not None:
                recent.ttfts.append((now, ttft_s))
            recent.trim(now - self.window_s)

    def forget(self, adapter: str) -> None:
        """Drop an adapter's record (it was unloaded)."""
        with self._lock:
            self._recent.pop(adapter, None)
        if self.metrics is not None:
            self.metrics.forget(adapter)

    def snapshot(self, names: Iterable[str], requests: Mapping[str, RequestCounts]) -> AdapterStatsSnapshot:
        """The demand of each of `names` now, with the backend's `requests` counts."""
        now = self.clock()
        stats = []
        with self._lock:
            for name in names:
                recent = self._recent.get(name, _Recent())
                recent.trim(now - self.window_s)
                counts = requests.get(name, RequestCounts())
                stats.append(_stat(name, counts, recent, self.window_s))
        return AdapterStatsSnapshot(time.time(), self.window_s, tuple(stats))


def _stat(name: str, counts: RequestCounts, recent: _Recent, window_s: float) -> AdapterStat:
    tokens = sum(count for _, count in recent.tokens)
    ttfts = [seconds for _, seconds in recent.ttfts]
    return AdapterStat(
        adapter=name,
        running=counts.running,
        waiting=counts.waiting,
        generated_tokens=tokens,
        tokens_per_s=tokens / window_s,
        ttft_count=len(ttfts),
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=statistics.median(ttfts) if ttfts else 0.0,
    )
