"""The router's pure parts: scorers and picker, in-flight accounting, prefix residency, discovery parsing."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.server.engine.kv_cache import KVCacheManager
from conveyor.server.engine.request import Request
from conveyor.server.messages import SamplingParams
from conveyor.server.router.config import RouterConfig
from conveyor.server.router.endpoints import Endpoint, ReplicaAdapters, read_metrics, slice_urls
from conveyor.server.router.prefix import PrefixIndex, block_hashes
from conveyor.server.router.scoring import Candidate, Weights, pick

W = Weights()


def choose(candidates, policy="prefix-aware", prompt_blocks=0, seed=0, turn=0, load_gate=8, max_waiting=64):
    return pick(
        candidates,
        policy,
        W,
        prompt_blocks=prompt_blocks,
        load_gate=load_gate,
        max_waiting=max_waiting,
        rng=random.Random(seed),
        turn=turn,
    )


candidates = st.lists(
    st.builds(
        Candidate,
        name=st.sampled_from([f"http://10.0.0.{i}:8000" for i in range(6)]),
        ready=st.booleans(),
        waiting=st.integers(0, 100),
        load=st.integers(0, 200),
        kv_usage=st.floats(0, 1),
        prefix_blocks=st.integers(0, 8),
    ),
    max_size=6,
    unique_by=lambda c: c.name,
)


@settings(max_examples=300, deadline=None)
@given(candidates, st.sampled_from(["prefix-aware", "least-load", "round-robin"]), st.integers(0, 1000))
def test_never_picks_an_unready_or_saturated_replica(cands, policy, seed) -> None:
    decision = choose(cands, policy, prompt_blocks=8, seed=seed, turn=seed, max_waiting=64)
    usable = {c.name for c in cands if c.ready and c.waiting < 64}
    if decision.endpoint is None:
        assert not usable
        assert decision.reason == ("no-ready" if not any(c.ready for c in cands) else "saturated")
    else:
        assert decision.endpoint in usable


def test_ties_are_broken_at_random_per_request() -> None:
    idle = [Candidate(f"http://r{i}", True, 0, 0) for i in range(3)]
    picks = Counter(choose(idle, seed=s).endpoint for s in range(300))
    assert set(picks) == {c.name for c in idle}
    assert min(picks.values()) > 60


def test_a_burst_spreads_over_idle_replicas_because_sends_count_at_decision_time() -> None:
    """Nine requests arrive before any poll: each pick counts at its replica at once (in_flight), so
    the burst lands three per replica instead of all on the first."""
    endpoints = {f"http://r{i}": Endpoint(f"http://r{i}", ready=True) for i in range(3)}
    rng = random.Random(1)
    for _ in range(9):
        decision = pick(
            [e.candidate(0) for e in endpoints.values()],
            "least-load",
            W,
            prompt_blocks=0,
            load_gate=8,
            max_waiting=64,
            rng=rng,
        )
        endpoints[decision.endpoint].in_flight += 1
        endpoints[decision.endpoint].sent_since_poll += 1
    assert [e.in_flight for e in endpoints.values()] == [3, 3, 3]


def test_load_counts_other_clients_seen_at_the_last_poll() -> None:
    """The replica reported 5 running of which 2 were this router's: 3 belong to others."""
    e = Endpoint(
        "http://r", ready=True, waiting=1, running=4, in_flight=2, in_flight_at_poll=2, sent_since_poll=1
    )
    c = e.candidate(0)
    assert (c.load, c.waiting) == (3 + 2, 1 + 1)


def test_prefix_affinity_wins_over_an_equal_load() -> None:
    a = Candidate("http://a", True, 0, 2, prefix_blocks=6)
    b = Candidate("http://b", True, 0, 2)
    for seed in range(20):
        decision = choose([a, b], prompt_blocks=6, seed=seed)
        assert (decision.endpoint, decision.reason) == ("http://a", "prefix")


def test_the_load_gate_breaks_affinity_for_a_replica_far_behind() -> None:
    holder = Candidate("http://a", True, 9, 20, prefix_blocks=8)
    idle = Candidate("http://b", True, 0, 1)
    decision = choose([holder, idle], prompt_blocks=8, load_gate=8)
    assert (decision.endpoint, decision.reason) == ("http://b", "gated")
    # Within the gate, affinity still decides.
    near = Candidate("http://a", True, 2, 8, prefix_blocks=8)
    assert choose([near, idle], prompt_blocks=8, load_gate=8).endpoint == "http://a"


def test_least_load_ignores_prefixes_and_round_robin_takes_turns() -> None:
    holder = Candidate("http://a", True, 0, 3, prefix_blocks=8)
    idle = Candidate("http://b", True, 0, 0)
    assert choose([holder, idle], "least-load", prompt_blocks=8).endpoint == "http://b"
    turns = [choose([idle, holder], "round-robin", turn=t).endpoint for t in range(4)]
    assert turns == ["http://a", "http://b", "http://a", "http://b"]


def test_kv_usage_breaks_an_equal_queue() -> None:
    full = Candidate("http://a", True, 0, 1, kv_usage=0.9)
    empty = Candidate("http://b", True, 0, 1, kv_usage=0.1)
    assert choose([full, empty]).endpoint == "http://b"


@given(st.lists(st.integers(0, 49151), max_size=100), st.sampled_from([1, 4, 16]))
def test_the_hash_chain_equals_the_engines(token_ids, block_size) -> None:
    request = Request("r", token_ids + [7], SamplingParams(), eos_token_id=None)
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    kv.get_computed_blocks(request)  # names every full block but the one holding the last token
    chain = block_hashes(token_ids + [7], block_size)
    assert request.block_hashes == chain[: len(request.block_hashes)]
    assert len(chain) == (len(token_ids) + 1) // block_size


def test_prefix_index_matches_leading_blocks_and_evicts_lru() -> None:
    chain = block_hashes(list(range(64)), 16)
    index = PrefixIndex(capacity=4)
    index.routed_to(chain[:3])
    assert index.match(chain) == 3
    # A block is named by its whole prefix: the same tokens after a different first block do not match.
    assert index.match(block_hashes([9, *range(1, 64)], 16)) == 0
    index.routed_to(block_hashes(list(range(100, 132)), 16))  # 2 more blocks: the oldest one goes
    assert index.match(chain) == 0


def test_prefix_index_follows_kv_events() -> None:
    chain = block_hashes(list(range(64)), 16)
    index = PrefixIndex()
    index.routed_to(chain[:1])
    index.apply_event(
        {"type": "snapshot", "block_size": 16, "num_blocks": 100, "hashes": [h.hex() for h in chain[:2]]}
    )
    assert (index.exact, index.capacity, index.match(chain)) == (True, 100, 2)
    index.apply_event({"type": "stored", "hashes": [chain[2].hex()]})
    assert index.match(chain) == 3
    index.routed_to(chain[3:])
    assert index.match(chain) == 4
    index.apply_event({"type": "evicted", "hashes": [chain[1].hex(), chain[3].hex()]})
    assert index.match(chain) == 1
    index.apply_event({"type": "cleared"})
    assert index.match(chain) == 0


def test_slice_urls_takes_ready_addresses_on_the_named_port() -> None:
    endpoint_slice = {
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
            {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
            {"addresses": ["10.0.0.3"]},
        ],
    }
    assert slice_urls(endpoint_slice, "http") == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert slice_urls(endpoint_slice, "grpc") == []
    v6 = {
        "addressType": "IPv6",
        "ports": [{"name": "http", "port": 80}],
        "endpoints": [{"addresses": ["fd00::1"]}],
    }
    assert slice_urls(v6, "http") == ["http://[fd00::1]:80"]


def test_read_metrics_of_a_replica() -> None:
    text = "\n".join(
        [
            "# TYPE conveyor:num_requests_waiting gauge",
            'conveyor:num_requests_waiting{model_name="m"} 3.0',
            "# TYPE conveyor:num_requests_running gauge",
            'conveyor:num_requests_running{model_name="m"} 5.0',
            "# TYPE conveyor:kv_cache_usage_perc gauge",
            'conveyor:kv_cache_usage_perc{model_name="m"} 0.25',
            "# TYPE conveyor:cache_config_info gauge",
            'conveyor:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="1024"} 1.0',
            "# TYPE conveyor:scheduler_config_info gauge",
            'conveyor:scheduler_config_info{max_num_batched_tokens="2048",max_num_seqs="11",model_name="m"} 1.0',
        ]
    )
    assert read_metrics(text) == (
        {
            "num_requests_waiting": 3.0,
            "num_requests_running": 5.0,
            "kv_cache_usage_perc": 0.25,
            "block_size": 16.0,
            "num_blocks": 1024.0,
            "max_num_seqs": 11.0,
        },
        None,
    )


def test_read_metrics_of_a_replica_with_lora_adapters() -> None:
    text = "\n".join(
        [
            "# TYPE conveyor:lora_requests_info gauge",
            'conveyor:lora_requests_info{max_lora="2",running_lora_adapters="sql,de",waiting_lora_adapters="fr"} 1.7e9',
            "# TYPE conveyor:lora_adapter_info gauge",
            'conveyor:lora_adapter_info{digest="d1",error="",lora_name="sql",model_name="m",path="/a/sql",state="loaded"} 1.0',
            'conveyor:lora_adapter_info{digest="d2",error="",lora_name="de",model_name="m",path="org/de",state="loaded"} 1.0',
            'conveyor:lora_adapter_info{digest="",error="rank",lora_name="bad",model_name="m",path="/b",state="failed"} 1.0',
        ]
    )
    _, adapters = read_metrics(text)
    assert adapters == ReplicaAdapters({"sql": "d1", "de": "d2"}, frozenset({"sql", "de", "fr"}), 2)
    assert (adapters.affinity("sql"), adapters.affinity("it")) == (1.0, 0.0)
    assert ReplicaAdapters({}, frozenset({"sql"}), 2).affinity("de") == 0.5  # a free slot


def test_an_adapter_request_goes_where_the_adapter_is_served_then_resident() -> None:
    def replica(name: str, served: set[str], active: set[str], load: int = 0) -> Candidate:
        endpoint = Endpoint(name, running=load)
        endpoint.ready = True
        endpoint.adapters = ReplicaAdapters({a: f"/adapters/{a}" for a in served}, frozenset(active), 1)
        return endpoint.candidate(0, "sql")

    # Only one replica serves it: it wins even when it is the busiest.
    decision = choose([replica("a", set(), set()), replica("b", {"sql"}, set(), load=9)])
    assert decision.endpoint == "b"
    # Both serve it: the one holding it resident wins at equal load, and the reason says so.
    decision = choose([replica("a", {"sql"}, {"de"}), replica("b", {"sql"}, {"sql"})])
    assert (decision.endpoint, decision.reason) == ("b", "adapter")
    # Nobody serves it (an unknown name): every replica stays a candidate, the replica answers 404.
    assert choose([replica("a", set(), set()), replica("b", set(), set())]).endpoint in ("a", "b")
    # A base-model request ignores adapters.
    base = Endpoint("c")
    base.ready = True
    assert base.candidate(0).serves_adapter and base.candidate(0).adapter_affinity == 0.0


def test_prefix_hashes_under_an_adapter_start_from_its_root() -> None:
    from conveyor.server.block_hash import lora_hash_root

    tokens = list(range(32))
    root = lora_hash_root("0123abcd")
    under, base = block_hashes(tokens, 16, root), block_hashes(tokens, 16)
    assert len(under) == len(base) == 2 and not set(under) & set(base)


def test_router_config_needs_exactly_one_source_of_replicas() -> None:
    with pytest.raises(ValueError, match="in one way"):
        RouterConfig()
    with pytest.raises(ValueError, match="in one way"):
        RouterConfig(endpoint=["http://a"], service="ns/svc")
    with pytest.raises(ValueError, match="in one way"):
        RouterConfig(service="ns/svc", endpoint_file="/tmp/replicas.txt")
    with pytest.raises(ValueError, match="service"):
        RouterConfig(service="not a service")
    assert RouterConfig(service="default/llm").policy == "prefix-aware"
    assert RouterConfig(endpoint_file="/tmp/replicas.txt").endpoint == []


def test_endpoint_file_lists_base_urls_and_skips_the_rest() -> None:
    """Comments and blank lines are ignored, duplicates and trailing slashes folded, and a line that is
    not a base URL is skipped rather than taking every replica out."""
    from conveyor.server.router.endpoints import read_endpoint_file

    text = "# replicas\nhttp://10.0.0.2:8000/\n\nhttp://10.0.0.1:8000  # first\nnot a url\nhttp://10.0.0.1:8000\n"
    assert read_endpoint_file(text) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_endpoint_file_watch_follows_the_file(tmp_path) -> None:
    """The watch reports the file's URLs at start, after an edit, and [] once the file is gone."""
    import threading

    from conveyor.server.router.endpoints import EndpointFileWatch

    path = tmp_path / "replicas.txt"
    path.write_text("http://127.0.0.1:9001\n")
    seen: list[list[str]] = []
    changed = threading.Event()

    def on_change(urls: list[str]) -> None:
        seen.append(urls)
        changed.set()

    watch = EndpointFileWatch(str(path), on_change, interval=0.05)
    watch.start()
    try:
        for expected, edit in (
            (["http://127.0.0.1:9001"], None),
            (
                ["http://127.0.0.1:9001", "http://127.0.0.1:9002"],
                "http://127.0.0.1:9001\nhttp://127.0.0.1:9002\n",
            ),
            ([], "remove"),
        ):
            if edit == "remove":
                path.unlink()
            elif edit is not None:
                path.write_text(edit)
            deadline = time.monotonic() + 10
            while (not seen or seen[-1] != expected) and time.monotonic() < deadline:
                changed.wait(0.1)
                changed.clear()
            assert seen[-1] == expected
    finally:
        watch.stop()


def test_a_burst_within_free_batch_slots_is_not_waiting() -> None:
    """Sends since the last poll fill an idle replica's 11 free batch slots before any counts as
    waiting (what --max-waiting-per-endpoint limits)."""
    e = Endpoint("http://r", ready=True, max_num_seqs=11)
    waiting = []
    for _ in range(14):
        waiting.append(e.candidate(0).waiting)
        e.in_flight += 1
        e.sent_since_poll += 1
    assert waiting == [0] * 12 + [1, 2]
    assert (
        Endpoint("http://r", ready=True, waiting=2, sent_since_poll=3).candidate(0).waiting == 5
    )  # limit unknown


def test_router_config_checks_replica_urls() -> None:
    for bad in ("127.0.0.1:8101", "ftp://x:1", "http://127.0.0.1:99999", "http://h:8000/v1"):
        with pytest.raises(ValueError, match="not a replica base URL"):
            RouterConfig(endpoint=[bad])
    assert (
        RouterConfig(endpoint=["http://10.0.0.7:8000", "https://[fd00::1]:443/"]).endpoint[0]
        == "http://10.0.0.7:8000"
    )
