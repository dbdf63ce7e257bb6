"""`materialize` under cpu_offload (framework/parallel/parallelize.py): the parameters on the host, where FSDP's
CPU offload wants them, and the buffers on the compute device, where the forward reads them (the MoE routing
bias every step). This CPU machine has no second device, so the meta device stands in for the GPU: a buffer
left on the host shows as a cpu tensor instead of a meta one (on a real GPU the forward would fail or copy it
every step). The parity of cpu_offload itself is tests/parallel/test_parity.py's."""

from __future__ import annotations

import torch

from framework.parallel.parallelize import materialize
from models.config import model_config
from models.decoder import Decoder

GPU_STAND_IN = torch.device("meta")


def _meta_model(preset: str) -> Decoder:
    with torch.device("meta"):
        return Decoder(model_config(preset))


def test_offloaded_parameters_live_on_the_host_and_buffers_on_the_device() -> None:
    part = _meta_model("test-moe")
    materialize(part, model_config("test-moe"), GPU_STAND_IN, seed=0, params_on_host=True)
    assert {p.device.type for p in part.parameters()} == {"cpu"}
    biases = {n: b.device.type for n, b in part.named_buffers() if n.endswith("expert_bias")}
    assert biases and set(biases.values()) == {"meta"}, biases
    # control: without offload everything lands on the one device asked for (here the host)
    plain = _meta_model("test-moe")
    materialize(plain, model_config("test-moe"), torch.device("cpu"), seed=0)
    assert {t.device.type for t in [*plain.parameters(), *plain.buffers()]} == {"cpu"}
    assert all(not b.any() for n, b in plain.named_buffers() if n.endswith("expert_bias"))  # reset to zero
