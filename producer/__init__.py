"""genq producer: the wire protocol, the client and the `genq` command line."""

from producer.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
