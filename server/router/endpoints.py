"""The replicas behind the router: their health, load and prefix residency (the router's I/O shell).

Each replica is polled every `scrape_interval`: `GET /health` (200 = ready) and `GET /metrics` (queue
depth, running requests, KV usage, `conveyor:cache_config_info` for its block size and KV block
count, and with LoRA its adapters: those it serves, from `conveyor:lora_adapter_info`, and those its
running and waiting requests use, from `conveyor:lora_requests_info`). A replica that fails a poll or a proxied connection is taken out and polled again with
exponential backoff (0.5 s doubling to 30 s) until it answers. Where prefix residency is exact, one
long-lived `GET /v1/kv_events` stream per replica feeds its PrefixIndex.

Replicas come from a static list, from the EndpointSlices of a Kubernetes Service (`EndpointSliceWatch`:
the kubernetes client's list + watch in a thread, relisting after any error), or from a file of URLs
(`EndpointFileWatch`: re-read when its size or modification time changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conveyor.server.router.config import is_base_url
from conveyor.server.router.prefix import PrefixIndex
from conveyor.server.router.scoring import Candidate

logger = logging.getLogger(__name__)

MAX_BACKOFF = 30.0


@dataclass(frozen=True)
class ReplicaAdapters:
    """A replica's LoRA adapters as its last poll read them: `served` (name -> the digest of its files,
    which seeds the adapter's prefix hashes), `active` (adapters of its running or waiting requests:
    resident in, or about to take, one of its `max_loras` slots)."""

    served: dict[str, str]
    active: frozenset[str]
    max_loras: int

    def affinity(self, adapter: str) -> float:
        """The lora score's input for a request of `adapter`: 1 resident, 0.5 a free slot, else 0."""
        if adapter in self.active:
            return 1.0
        return 0.5 if len(self.active) < self.max_loras else 0.0


@dataclass
class Endpoint:
    """One replica. `in_flight`: requests this router has at the replica now (one writer: the proxy,
    at decision time and when the response ends); the other load fields are the last poll's."""

    url: str
    index: PrefixIndex = field(default_factory=PrefixIndex)
    ready: bool = False
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    max_num_seqs: int | None = None
    adapters: ReplicaAdapters | None = None  # None: the replica serves no LoRA adapters
    in_flight: int = 0
    in_flight_at_poll: int = 0
    sent_since_poll: int = 0
    failures: int = 0
    polled_at: float = 0.0

    def candidate(self, prefix_blocks: int, adapter: str | None = None) -> Candidate:
        """What the picker knows of this replica for a request whose prompt's first `prefix_blocks`
        blocks it holds, under LoRA `adapter` (None: the base model)."""
        # The replica's counts include this router's requests as of the poll; the rest is other
        # clients' (other router replicas), which this router cannot see in between polls.
        others = max(0, self.waiting + self.running - self.in_flight_at_poll)
        # Sends since the poll are assumed still there; they queue only beyond free batch slots.
        at_replica = self.waiting + self.running + self.sent_since_poll
        if self.max_num_seqs is not None:
            waiting = max(self.waiting, at_replica - self.max_num_seqs)
        else:
            waiting = self.waiting + self.sent_since_poll
        return Candidate(
            name=self.url,
            ready=self.ready,
            waiting=waiting,
            load=others + self.in_flight,
            kv_usage=self.kv_usage,
            prefix_blocks=prefix_blocks,
            serves_adapter=adapter is None or (self.adapters is not None and adapter in self.adapters.served),
            adapter_affinity=self.adapters.affinity(adapter) if adapter and self.adapters else 0.0,
        )

    def backoff(self) -> float:
        return min(MAX_BACKOFF, 0.5 * 2 ** max(0, self.failures - 1))


def read_metrics(text: str) -> tuple[dict[str, float], ReplicaAdapters | None]:
    """The replica's load series summed over label sets, plus `block_size` / `num_blocks` /
    `max_num_seqs` when it exports `conveyor:cache_config_info` / `conveyor:scheduler_config_info`;
    and its LoRA adapters when it exports `conveyor:lora_requests_info` (None otherwise). Raises
    ValueError for text that is not Prometheus format."""
    values: dict[str, float] = {}
    served: dict[str, str] = {}
    lora_info: dict[str, str] | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "conveyor:lora_adapter_info" and sample.labels.get("state") == "loaded":
                served[sample.labels.get("lora_name", "")] = sample.labels.get("digest", "")
                continue
            if sample.name == "conveyor:lora_requests_info":
                lora_info = sample.labels
                continue
            if sample.name in ("conveyor:cache_config_info", "conveyor:scheduler_config_info"):
                for key, label in (
                    ("block_size", "block_size"),
                    ("num_blocks", "num_gpu_blocks"),
                    ("max_num_seqs", "max_num_seqs"),
                ):
                    if label in sample.labels:
                        values[key] = float(sample.labels[label])
            elif sample.name in (
                "conveyor:num_requests_waiting",
                "conveyor:num_requests_running",
                "conveyor:kv_cache_usage_perc",
            ):
                key = sample.name.removeprefix("conveyor:")
                values[key] = values.get(key, 0.0) + sample.value
    if lora_info is None:
        return values, None
    active = {
        name
        for key in ("running_lora_adapters", "waiting_lora_adapters")
        for name in lora_info.get(key, "").split(",")
        if name
    }
    return values, ReplicaAdapters(served, frozenset(active), int(lora_info.get("max_lora") or 1))


class EndpointPool:
    """The live set of replicas, updated by discovery, polled in the background.

    prefix_mode: `exact` / `auto` subscribe to each replica's `/v1/kv_events` (`auto` falls back to
    routed-only residency where a replica answers 404); `approximate` never does.
    """

    def __init__(self, client: httpx.AsyncClient, scrape_interval: float, prefix_mode: str) -> None:
        self.client = client
        self.scrape_interval = scrape_interval
        self.prefix_mode = prefix_mode
        self.endpoints: dict[str, Endpoint] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._changed = asyncio.Condition()

    # -- membership -----------------------------------------------------------------------------------

    def set_urls(self, urls: list[str]) -> None:
        """Make the pool exactly `urls` (base URLs without a trailing slash). Requests already at a
        removed replica finish there."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self.endpoints):
            if url not in wanted:
                logger.info("replica %s removed", url)
                for task in self._tasks.pop(url, []):
                    task.cancel()
                del self.endpoints[url]
                del self._wake[url]
        for url in sorted(wanted - self.endpoints.keys()):
            logger.info("replica %s added", url)
            endpoint = Endpoint(url)
            self.endpoints[url] = endpoint
            self._wake[url] = asyncio.Event()
            tasks = [asyncio.create_task(self._poll(endpoint), name=f"poll {url}")]
            if self.prefix_mode != "approximate":
                tasks.append(asyncio.create_task(self._follow_events(endpoint), name=f"kv events {url}"))
            self._tasks[url] = tasks
        self._notify()

    async def close(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def poll_unready_now(self) -> None:
        """Cut the backoff of every replica not ready: requests are waiting for one (scale from zero)."""
        for url, endpoint in self.endpoints.items():
            if not endpoint.ready:
                self._wake[url].set()

    def ready(self) -> list[Endpoint]:
        return [e for e in self.endpoints.values() if e.ready]

    async def wait_changed(self, timeout: float) -> None:
        """Return when a replica is added or changes readiness, or after `timeout` seconds."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    def _notify(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    # -- health and load ------------------------------------------------------------------------------

    def mark_failed(self, endpoint: Endpoint, why: str) -> None:
        """A proxied request could not reach the replica: take it out until a poll succeeds."""
        if endpoint.ready:
            logger.warning("replica %s taken out: %s", endpoint.url, why)
        endpoint.ready = False
        endpoint.failures += 1
        self._notify()

    async def poll_once(self, endpoint: Endpoint) -> None:
        """Read the replica's /health and /metrics once and update its state."""
        was_ready = endpoint.ready
        in_flight = endpoint.in_flight
        try:
            health = await self.client.get(f"{endpoint.url}/health", timeout=5.0)
            ready = health.status_code == 200
            metrics = await self.client.get(f"{endpoint.url}/metrics", timeout=5.0)
            metrics.raise_for_status()
            values, adapters = read_metrics(metrics.text)
        except (httpx.HTTPError, ValueError) as exc:
            endpoint.ready = False
            endpoint.failures += 1
            if was_ready or endpoint.failures == 1:
                logger.warning("replica %s not reachable: %s", endpoint.url, exc or type(exc).__name__)
        else:
            endpoint.ready = ready
            endpoint.failures = 0 if ready else endpoint.failures + 1
            endpoint.waiting = int(values.get("num_requests_waiting", 0))
            endpoint.running = int(values.get("num_requests_running", 0))
            endpoint.kv_usage = values.get("kv_cache_usage_perc", 0.0)
            endpoint.adapters = adapters
            if "block_size" in values:
                endpoint.block_size = int(values["block_size"])
            if "max_num_seqs" in values:
                endpoint.max_num_seqs = int(values["max_num_seqs"])
            if "num_blocks" in values and not endpoint.index.exact:
                endpoint.index.capacity = int(values["num_blocks"])
            endpoint.in_flight_at_poll = in_flight
            endpoint.sent_since_poll = 0
            endpoint.polled_at = time.monotonic()
        if endpoint.ready != was_ready:
            if endpoint.ready:
                logger.info("replica %s ready", endpoint.url)
            self._notify()

    async def _poll(self, endpoint: Endpoint) -> None:
        wake = self._wake[endpoint.url]
        while True:
            await self.poll_once(endpoint)
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    wake.wait(), self.scrape_interval if endpoint.ready else endpoint.backoff()
                )

    async def _follow_events(self, endpoint: Endpoint) -> None:
        """Keep the replica's KV event stream open; reconnect (and get a new snapshot) after a break."""
        attempt = 0
        while True:
            try:
                async with self.client.stream(
                    "GET", f"{endpoint.url}/v1/kv_events", timeout=httpx.Timeout(5.0, read=None)
                ) as response:
                    if response.status_code == 404 and self.prefix_mode == "auto":
                        logger.info(
                            "replica %s publishes no KV events: approximate prefix residency", endpoint.url
                        )
                        return
                    response.raise_for_status()
                    attempt = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            endpoint.index.apply_event(json.loads(line[6:]))
            except (httpx.HTTPError, ValueError) as exc:
                logger.debug("KV events of %s interrupted: %s", endpoint.url, exc)
            endpoint.index.exact = False
            attempt += 1
            await asyncio.sleep(min(MAX_BACKOFF, 0.5 * 2 ** (attempt - 1)))


def slice_urls(endpoint_slice: dict, port_name: str) -> list[str]:
    """Base URLs of the ready addresses of one EndpointSlice (its API JSON, camelCase) on the port
    named `port_name`; [] when the slice has no such port. An endpoint without a `ready` condition
    counts as ready, as the EndpointSlice API defines."""
    ports = [p.get("port") for p in endpoint_slice.get("ports") or [] if p.get("name") == port_name]
    if not ports or ports[0] is None:
        return []
    family = endpoint_slice.get("addressType", "IPv4")
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if family == "IPv6" else address
            urls.append(f"http://{host}:{ports[0]}")
    return urls


class EndpointSliceWatch:
    """Follows the EndpointSlices of Service `namespace/service` (label `kubernetes.io/service-name`)
    and calls `on_change(urls)` with the union of their ready addresses after every change. Runs the
    kubernetes client's blocking list + watch in a daemon thread; credentials from the pod's service
    account, else the kubeconfig."""

    def __init__(
        self, namespace: str, service: str, port_name: str, on_change: Callable[[list[str]], None]
    ) -> None:
        self.namespace, self.service, self.port_name = namespace, service, port_name
        self.on_change = on_change
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    @staticmethod
    def _api():
        """A DiscoveryV1Api with its own configuration (the process-wide default is left alone)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        return client.DiscoveryV1Api(client.ApiClient(configuration))

    def _run(self) -> None:
        from kubernetes import watch

        selector = f"kubernetes.io/service-name={self.service}"
        delay = 0.5
        api = None
        while not self._stopped.is_set():
            try:
                # Inside the retry: missing credentials are logged and retried, never a dead thread.
                api = api or self._api()
                serialize = api.api_client.sanitize_for_serialization
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: slice_urls(serialize(s), self.port_name) for s in listed.items}
                self._publish(slices)
                delay = 0.5
                stream = watch.Watch().stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                )
                for event in stream:
                    if self._stopped.is_set():
                        return
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        slices.pop(obj.metadata.name, None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        slices[obj.metadata.name] = slice_urls(serialize(obj), self.port_name)
                    self._publish(slices)
            except Exception as exc:  # API unreachable, 410 Gone, bad credentials: relist after a pause
                logger.warning("watching EndpointSlices of %s/%s: %s", self.namespace, self.service, exc)
                self._stopped.wait(delay)
                delay = min(MAX_BACKOFF, delay * 2)

    def _publish(self, slices: dict[str, list[str]]) -> None:
        self.on_change(sorted({u for urls in slices.values() for u in urls}))


def read_endpoint_file(text: str) -> list[str]:
    """Replica base URLs of an endpoint file: one per line, blank lines and `#` comments ignored, lines
    that are not base URLs logged and skipped (a half-edited file must not take every replica out)."""
    urls = []
    for number, line in enumerate(text.splitlines(), 1):
        url = line.split("#", 1)[0].strip()
        if not url:
            continue
        if is_base_url(url):
            urls.append(url.rstrip("/"))
        else:
            logger.warning(
                "endpoint file line %d: %r is not a base URL like http://10.0.0.7:8000", number, url
            )
    return sorted(set(urls))


class EndpointFileWatch:
    """Calls `on_change(urls)` with the URLs of file `path` at start and after every change (polled every
    `interval` seconds in a daemon thread). A missing or unreadable file means no replicas, logged."""

    def __init__(self, path: str, on_change: Callable[[list[str]], None], interval: float = 1.0) -> None:
        self.path, self.on_change, self.interval = path, on_change, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="endpoint-file-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        seen: tuple[int, int] | None = None
        urls: list[str] | None = None
        while not self._stopped.is_set():
            try:
                stat = os.stat(self.path)
                version = (stat.st_mtime_ns, stat.st_size)
                if version != seen:
                    with open(self.path) as file:
                        current = read_endpoint_file(file.read())
                    seen = version
                else:
                    current = urls
            except OSError as exc:
                if urls != []:
                    logger.warning("endpoint file %s: %s: no replicas", self.path, exc)
                current, seen = [], None
            if current != urls:
                urls = current
                self.on_change(list(urls or []))
            self._stopped.wait(self.interval)
