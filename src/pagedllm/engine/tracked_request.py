"""A request in flight through the engine process, as the API server's side knows it
(engine/core_client.py): enough to resubmit it to another engine process. Its outputs so far
(what a resume sends back, as token ids) are the output processor's."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.streams import RequestStream
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest


@dataclass
class TrackedRequest:
    request: EngineCoreRequest  # as sent to the first engine process (resumed: None)
    stream: RequestStream
    sent: bool = False  # added to the current engine process
    num_faults: int = 0  # engine failures blamed on requests it was in flight for
    probation: bool = False  # runs only alone among requests on probation
    handed_out: bool = False  # an output reached the caller

    @property
    def resumable(self) -> bool:
        params = self.request.params
        if isinstance(params, PoolingParams):
            return True  # nothing handed out before its one output
        return params.num_sequences == 1 and not params.use_beam_search
