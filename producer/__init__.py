"""genq producer: the wire protocol, the client and the `genq` command line."""

from producer.async_client import AsyncClient, AsyncJobHandle
from producer.client import Client, JobHandle
from producer.jobs import Delta, JobFailed, JobLost, JobNotFound, JobResult
from producer.pooling_params import PoolingParams
from producer.protocol import JobStatus, Keys, ProtocolError
from producer.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "AsyncClient",
    "AsyncJobHandle",
    "Client",
    "Delta",
    "JobFailed",
    "JobHandle",
    "JobLost",
    "JobNotFound",
    "JobResult",
    "JobStatus",
    "Keys",
    "PoolingParams",
    "ProtocolError",
    "SamplingParams",
    "StructuredOutputsParams",
]
