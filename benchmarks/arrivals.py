"""Request arrival times for online benchmarks (pure, seeded).

As in vLLM's ``bench serve``: inter-arrival gaps are gamma-distributed with shape ``burstiness`` and
mean ``1 / request_rate``. ``burstiness == 1`` is a Poisson process (exponential gaps); below 1 arrivals
bunch up, above 1 they are more regular. An infinite rate sends everything at time 0 (offline).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send time of each request in seconds after the start; the first request goes at 0.

    Raises ValueError for a non-positive rate or burstiness.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf for all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
