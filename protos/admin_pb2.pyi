from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SetExecutorsRequest(_message.Message):
    __slots__ = ("addresses",)
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class SetExecutorsResponse(_message.Message):
    __slots__ = ("address", "model_name", "moved_sequences")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MOVED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    address: str
    model_name: str
    moved_sequences: int
    def __init__(self, address: _Optional[str] = ..., model_name: _Optional[str] = ..., moved_sequences: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("executor_address", "executor_attached", "running", "waiting", "swapped", "gpu_blocks_used", "gpu_blocks_total", "cpu_blocks_used", "cpu_blocks_total", "steps", "resyncs", "draining", "model_name", "attach_error", "loop_failures")
    EXECUTOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOOP_FAILURES_FIELD_NUMBER: _ClassVar[int]
    executor_address: str
    executor_attached: bool
    running: int
    waiting: int
    swapped: int
    gpu_blocks_used: int
    gpu_blocks_total: int
    cpu_blocks_used: int
    cpu_blocks_total: int
    steps: int
    resyncs: int
    draining: bool
    model_name: str
    attach_error: str
    loop_failures: int
    def __init__(self, executor_address: _Optional[str] = ..., executor_attached: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., swapped: _Optional[int] = ..., gpu_blocks_used: _Optional[int] = ..., gpu_blocks_total: _Optional[int] = ..., cpu_blocks_used: _Optional[int] = ..., cpu_blocks_total: _Optional[int] = ..., steps: _Optional[int] = ..., resyncs: _Optional[int] = ..., draining: _Optional[bool] = ..., model_name: _Optional[str] = ..., attach_error: _Optional[str] = ..., loop_failures: _Optional[int] = ...) -> None: ...
