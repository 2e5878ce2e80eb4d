"""NVML device names -> the planner's device profile (``planner.devices.known_type``).

One row per name as the NVIDIA driver (``nvmlDeviceGetName``, ``torch.cuda.get_device_name``)
reports it. Each is checked as the driver's name (what ``scripts/bench_step`` looks up) and as
the agent's type (``nvml_driver.device_type``: the name without ``NVIDIA ``, blanks as dashes,
what the node record advertises and the leader plans with). ``None``: not in the table, so the
leader plans it with the conservative ``generic_gpu_spec``.
"""

from __future__ import annotations

import pytest

from hspmd_elastic.planner import PlannerError, inventory_from_nodes, lookup_spec, spec_for_device
from hspmd_elastic.planner.devices import generic_gpu_spec, known_type, spec_table
from launcher.health.nvml_driver import device_type

# name -> (profile, dense bf16 peak TFLOP/s); None: unknown
NAMES = {
    # Hopper SXM
    "NVIDIA H100 80GB HBM3": ("H100", 989.0),
    "NVIDIA H200": ("H200", 989.0),
    "NVIDIA H800": ("H800", 989.0),
    "NVIDIA H20": ("H20", 148.0),
    # Hopper PCIe and NVL cards: their own, lower peaks, not the SXM one
    "NVIDIA H100 PCIe": ("H100-PCIe", 756.0),
    "NVIDIA H100 NVL": ("H100-NVL", 835.0),
    "NVIDIA H200 NVL": ("H200-NVL", 835.0),
    "NVIDIA H800 PCIe": ("H800-PCIe", 756.0),
    "NVIDIA H100 80GB PCIe": ("H100-PCIe", 756.0),  # (a form with the memory size first)
    # Ampere, Ada
    "NVIDIA A100-SXM4-80GB": ("A100", 312.0),
    "NVIDIA A100-SXM4-40GB": ("A100", 312.0),
    "NVIDIA A100 80GB PCIe": ("A100-PCIe", 312.0),
    "NVIDIA A100-PCIE-40GB": ("A100-PCIe", 312.0),
    "NVIDIA L40S": ("L40S", 362.0),
    # not in the table: no partial-word matches (H20 is not H200, L40 is not L40S)
    "NVIDIA L40": None,
    "NVIDIA GeForce RTX 4090": None,
    "Tesla V100-SXM2-32GB": None,
    "NVIDIA GH200 480GB": None,
}


@pytest.mark.parametrize("name", NAMES)
def test_nvml_name_maps_to_its_profile(name):
    expected = NAMES[name]
    table = spec_table()
    for form in (name, device_type(name), name.upper(), name.lower()):
        key = known_type(form, table)
        if expected is None:
            assert key is None, (form, key)
            continue
        assert key is not None and table[key].name == expected[0], (form, key)
        assert table[key].peak_tflops == expected[1]
        spec = spec_for_device(form, 100 << 30)
        assert (spec.name, spec.peak_tflops, spec.memory_bytes) == (*expected, 100 << 30)


@pytest.mark.parametrize("name", [n for n, e in NAMES.items() if e is None])
def test_unknown_gpus_get_the_conservative_profile_under_their_own_name(name):
    spec = spec_for_device(device_type(name), 24 << 30)
    generic = generic_gpu_spec(device_type(name))
    assert (spec.name, spec.peak_tflops, spec.mfu) == (generic.name, generic.peak_tflops,
                                                       generic.mfu)
    assert spec.memory_bytes == 24 << 30
    assert spec.peak_tflops < min(s.peak_tflops for s in spec_table().values()
                                  if s.name != "CPU")
    with pytest.raises(PlannerError, match="unknown device type"):
        lookup_spec(device_type(name))


def test_nvl_and_pcie_cards_are_not_planned_as_sxm():
    sxm, nvl = lookup_spec("H200"), lookup_spec("H200-NVL")
    assert nvl.memory_bytes == sxm.memory_bytes and nvl.peak_tflops < sxm.peak_tflops
    assert nvl.intra_node_gbps < sxm.intra_node_gbps  # bridges join 2-4 cards; PCIe between
    assert lookup_spec("H100-PCIe").intra_node_gbps < lookup_spec("H100").intra_node_gbps
    inv = inventory_from_nodes("2xH200-NVL,1xH200,1xH100-NVL,1xH100-PCIe,1xA100-80GB-PCIe")
    assert [d.spec.name for d in inv.devices] == ["H200-NVL", "H200-NVL", "H200", "H100-NVL",
                                                  "H100-PCIe", "A100-PCIe"]
