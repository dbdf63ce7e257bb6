"""What the overlapped Muon exchange's backward hook (framework/train/muon_overlap.py) guarantees on the GPU, checked
on its CPU code path with FSDP's state stood in for: the all-to-all is launched only after the current stream of
the unit's own device has waited for FSDP's post-reduce event (the gradients are written on FSDP's reduce stream)
and, under parallel.cpu_offload, after the gradients' copies to host memory are done; and only the first module
of a grouped FSDP unit to enter forward wraps its input (the one FSDP registers its post-backward on). The gloo
runs in tests/parallel/test_muon_parity.py cover the rest; on CPU FSDP records no event, so they never reach the
wait."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from framework.train.muon_overlap import BackwardExchange


class _Stream:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def wait_event(self, event: object) -> None:
        self.log.append(("wait", event))


def _unit(log: list[tuple[str, Any]], events: list[object | None], state: TrainingState,
          offloaded: int = 0) -> SimpleNamespace:
    """An FSDP state with one param group per post-reduce event, the first holding `offloaded` parameters whose
    gradient copy to host memory is still in flight (parallel.cpu_offload) beside one that is not offloaded."""
    handle = SimpleNamespace(current_stream=lambda: _Stream(log))
    copies = [SimpleNamespace(grad_offload_event=SimpleNamespace(synchronize=lambda k=k: log.append(("copy", k))))
              for k in range(offloaded)] + [SimpleNamespace(grad_offload_event=None)]
    groups = [SimpleNamespace(_post_reduce_event=e, device_handle=handle, _training_state=state,
                              fsdp_params=copies if i == 0 else []) for i, e in enumerate(events)]
    return SimpleNamespace(_fsdp_param_groups=groups)


def _exchange(log: list[tuple[str, Any]], params: tuple[torch.Tensor, ...]) -> BackwardExchange:
    """An exchange over one stand-in optimizer stepping `params` (no model parts: the hooks are made by hand)."""
    opt = SimpleNamespace(_whole=SimpleNamespace(params=list(params)), _exchanged=list,
                          launch=lambda sent: log.append(("launch", tuple(sent))))
    return BackwardExchange([opt], [])  # type: ignore[list-item]


def test_launch_waits_for_fsdp_post_reduce_events_on_the_units_device_stream() -> None:
    log: list[tuple[str, Any]] = []
    first, second = object(), object()
    params = (torch.zeros(2),)
    unit = _unit(log, [first, None, second], TrainingState.IDLE, offloaded=2)
    hook = _exchange(log, params)._pre_forward(unit, params)
    x = torch.ones(3, requires_grad=True)
    wrapped = hook(torch.nn.Identity(), (x, "kwarg-free extra"))
    assert wrapped is not None and wrapped[1] == "kwarg-free extra"
    assert log == []  # nothing before backward
    (wrapped[0] * 2).sum().backward()
    assert log == [("wait", first), ("copy", 0), ("copy", 1), ("wait", second), ("launch", params)]
    assert torch.equal(x.grad, torch.full((3,), 2.0))  # the identity passes the gradient through


def test_only_the_first_module_of_a_unit_to_enter_forward_wraps_its_input() -> None:
    log: list[tuple[str, Any]] = []
    x, params = torch.ones(3, requires_grad=True), (torch.zeros(2),)
    entered = _exchange(log, params)._pre_forward(_unit(log, [None], TrainingState.FORWARD), params)
    assert entered(torch.nn.Identity(), (x,)) is None  # FSDP registered its post-backward on another module's input
    for state in (TrainingState.IDLE, TrainingState.POST_BACKWARD):
        first = _exchange(log, params)._pre_forward(_unit(log, [None], state), params)
        assert first(torch.nn.Identity(), (x,)) is not None
    with torch.no_grad():
        assert first(torch.nn.Identity(), (x,)) is None
    assert first(torch.nn.Identity(), (torch.ones(3),)) is None  # no gradient flows back through it
