"""genq producer: the wire protocol, the client and the `genq` command line."""

from producer.client import (
    AsyncClient,
    AsyncJobHandle,
    Client,
    Delta,
    JobFailed,
    JobHandle,
    JobNotFound,
    JobResult,
)
from producer.protocol import JobStatus, Keys, ProtocolError
from producer.sampling_params import SamplingParams

__all__ = [
    "AsyncClient",
    "AsyncJobHandle",
    "Client",
    "Delta",
    "JobFailed",
    "JobHandle",
    "JobNotFound",
    "JobResult",
    "JobStatus",
    "Keys",
    "ProtocolError",
    "SamplingParams",
]
