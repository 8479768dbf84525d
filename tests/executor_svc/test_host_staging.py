"""HostStaging on the CPU: buffers taken in turn, and a send copies only its range of the buffer
taken last into the twin."""
import torch

from executor_svc.host_staging import HostStaging


def test_buffers_alternate_and_a_send_copies_only_its_range():
    staging = HostStaging(6, torch.device("cpu"))
    first = staging.take()
    first[:] = [1, 2, 3, 4, 5, 6]
    assert staging.send(0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    second = staging.take()
    assert second is not first  # the first may still be in its copy on a GPU
    second[:] = 9
    assert staging.send(2, 4).tolist() == [1, 2, 9, 9, 5, 6]
    assert staging.take() is first
