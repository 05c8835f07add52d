"""The metrics of MIG devices, labelled as dcgm-exporter labels its series of them: `gpu` and `UUID` their GPU's,
`GPU_I_ID` and `GPU_I_PROFILE` their own (docs/design.md §12), so `on(UUID, GPU_I_ID)` joins the two exporters;
a whole GPU's GPU_I_ID and GPU_I_PROFILE are empty, which Prometheus reads as absent."""

from __future__ import annotations

import dataclasses
from collections import Counter

from forge_load.control.status import GpuSlot, GpuSlots
from forge_load.service import metrics
from tests.test_metrics import sample_values, scrape, simulated_slots

# Two MIG devices of one GPU with the same profile: only GPU_I_ID tells their series apart.
PROFILE = "3g.40gb"
GPU_INSTANCES = (1, 2)
MIG_UUIDS = tuple(f"MIG-5a1e0000-0000-4000-8000-00000000000{gi}" for gi in GPU_INSTANCES)
EMPTY_MIG_LABELS = {"GPU_I_ID": "", "GPU_I_PROFILE": ""}


def mig_slots() -> tuple[GpuSlots, GpuSlot, list[GpuSlot]]:
    """A simulated filler's GPU (its slot taken out) and two MIG devices of it, each attached as
    gpu_threads.fill_in_child attaches one: its own DeviceInfo, a status snapshot, a heartbeat."""
    gpu_slots, whole, rt = simulated_slots("--duration 3 --max-power-w 650")
    assert whole.info is not None
    gpu_slots.slots = []
    migs = []
    for gi, mig_uuid in zip(GPU_INSTANCES, MIG_UUIDS):
        slot = gpu_slots.add(mig_uuid)
        slot.attach(dataclasses.replace(whole.info, uuid=mig_uuid, name=f"{whole.info.name} MIG {PROFILE}",
                                        gpu_instance=gi, mig_profile=PROFILE, gpu_uuid=whole.info.uuid),
                    lambda: rt.filler.status(rt.now()))
        slot.beat()
        migs.append(slot)
    return gpu_slots, whole, migs


def per_gpu_samples(values: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, list[dict[str, str]]]:
    """Every family's samples but build_info's, by sample name: their label sets."""
    return {name: [labels for labels, _ in samples] for name, samples in values.items()
            if name != "forge_load_build_info"}


def test_every_series_of_a_mig_device_carries_its_gpus_uuid_and_its_gpu_instance() -> None:
    gpu_slots, whole, migs = mig_slots()
    values = sample_values(scrape(gpu_slots))
    samples = per_gpu_samples(values)
    assert set(samples) == set(metrics.METRICS) - {"forge_load_build_info"}  # mig_info included
    for name, label_sets in samples.items():
        by_instance = {labels["GPU_I_ID"]: labels for labels in label_sets}
        assert set(by_instance) == {str(gi) for gi in GPU_INSTANCES}, (name, label_sets)
        for labels in label_sets:
            assert labels["gpu"] == str(whole.index) and labels["UUID"] == whole.uuid, (name, labels)
            assert whole.uuid.startswith("GPU-") and labels["GPU_I_PROFILE"] == PROFILE, (name, labels)
    assert [slot.uuid for slot in migs] == list(MIG_UUIDS)  # /health and the logs still name the MIG device


def test_two_mig_devices_of_one_gpu_never_make_duplicate_series() -> None:
    gpu_slots, _, _ = mig_slots()
    for name, label_sets in per_gpu_samples(sample_values(scrape(gpu_slots))).items():
        counts = Counter(tuple(sorted(labels.items())) for labels in label_sets)
        assert all(count == 1 for count in counts.values()), (name, counts)


def test_mig_info_maps_each_mig_devices_own_uuid_to_its_gpu_instance() -> None:
    gpu_slots, whole, _ = mig_slots()
    info = sample_values(scrape(gpu_slots))["forge_load_mig_info"]
    assert sorted(info, key=lambda sample: sample[0]["mig_uuid"]) == [
        ({"gpu": str(whole.index), "UUID": whole.uuid, "GPU_I_ID": str(gi), "GPU_I_PROFILE": PROFILE,
          "mig_uuid": mig_uuid}, 1.0) for gi, mig_uuid in zip(GPU_INSTANCES, MIG_UUIDS)]


def test_a_whole_gpus_series_have_empty_gpu_instance_labels_and_no_mig_info() -> None:
    gpu_slots, slot, _ = simulated_slots("--duration 3 --max-power-w 650")
    samples = per_gpu_samples(sample_values(scrape(gpu_slots)))
    assert "forge_load_mig_info" not in samples
    for name, label_sets in samples.items():
        for labels in label_sets:
            assert {k: labels[k] for k in ("gpu", "UUID", *EMPTY_MIG_LABELS)} == {
                "gpu": str(slot.index), "UUID": slot.uuid, **EMPTY_MIG_LABELS}, (name, labels)


def test_a_mig_device_not_yet_open_keeps_the_name_it_was_asked_by() -> None:
    # Before it is open nothing says which GPU it is on: the series carry the MIG device's own UUID.
    gpu_slots = GpuSlots()
    gpu_slots.add(MIG_UUIDS[0]).failed("no usable GPU", 3)
    assert sample_values(scrape(gpu_slots))["forge_load_up"] == [
        ({"gpu": "", "UUID": MIG_UUIDS[0], **EMPTY_MIG_LABELS}, 0.0)]


def test_a_mig_device_whose_gpu_nvml_did_not_name_keeps_its_own_uuid() -> None:
    # Its GPU_I_ID is no key without its GPU's UUID: UUID stays the MIG device's own, one series per device.
    gpu_slots, _, migs = mig_slots()
    for slot in migs:
        assert slot.info is not None
        slot.info = dataclasses.replace(slot.info, gpu_uuid="")
    up = sample_values(scrape(gpu_slots))["forge_load_up"]
    assert sorted(labels["UUID"] for labels, _ in up) == sorted(MIG_UUIDS)


def test_health_names_each_mig_device_by_its_own_uuid() -> None:
    gpu_slots, _, migs = mig_slots()
    ok, body = gpu_slots.health()
    lines = body.splitlines()
    assert ok and lines[0] == "ok" and len(lines) == 1 + len(migs)
    for line, mig_uuid in zip(lines[1:], MIG_UUIDS):
        assert mig_uuid in line, (line, mig_uuid)
