"""Host side of the engine: requests, sampling parameters, allocators, scheduler, batch plans.

Nothing in this package imports JAX: it works on Python objects and numpy
arrays and can be tested with no device (tests/test_scheduler.py checks that).
"""

from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus", "SamplingParams"]
