"""The hardware table: packaged rows, agreement with the MFU peak table, user files, errors."""

from __future__ import annotations

import math

import pytest

from forja.errors import ForjaError
from forja.metrics.throughput import lookup_peak
from forja.plan.hardware import ENV_VAR, Hardware, get_hardware, hardware_for_device, load_hardware
from forja.plan.layout import Layout
from forja.plan.planner import evaluate
from forja.plan.speed import predict_time

# kind -> a name torch.cuda.get_device_name() reports, for throughput.py's table.
DEVICE_NAMES = {
    "h100": "NVIDIA H100 80GB HBM3", "h100-pcie": "NVIDIA H100 PCIe", "h200": "NVIDIA H200",
    "a100": "NVIDIA A100-SXM4-80GB", "a100-40gb": "NVIDIA A100-SXM4-40GB", "b200": "NVIDIA B200",
    "gb200": "NVIDIA GB200", "mi300x": "AMD Instinct MI300X", "l40s": "NVIDIA L40S",
}


@pytest.fixture(autouse=True)
def _no_user_file(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)  # a developer's own file must not change the tests


def write(tmp_path, text):
    path = tmp_path / "hw.toml"
    path.write_text(text)
    return path


def test_packaged_table_loads_in_si_units():
    table = load_hardware()
    assert set(DEVICE_NAMES) | {"cpu"} <= set(table)
    h100 = table["h100"]
    assert isinstance(h100, Hardware) and h100.kind == "h100"
    assert h100.memory_bytes == 79.2 * 2 ** 30
    assert h100.intra_node_bytes_per_s == 450e9 and h100.inter_node_bytes_per_s == 50e9
    assert h100.gpus_per_node == 8 and h100.source
    assert table["a100"].fp8_flops == 0


@pytest.mark.parametrize("kind", sorted(DEVICE_NAMES))
def test_peaks_equal_the_mfu_table(kind):
    hw, peak = get_hardware(kind), lookup_peak(DEVICE_NAMES[kind])
    assert peak is not None, kind
    assert hw.bf16_flops == pytest.approx(peak.bf16 * 1e12, rel=1e-12)
    assert hw.fp32_flops == pytest.approx(peak.fp32 * 1e12, rel=1e-12)
    assert hw.fp8_flops == pytest.approx((peak.fp8 or 0) * 1e12, rel=1e-12)


def test_h100_bf16_peak_is_throughputs():
    assert get_hardware("h100").bf16_flops == pytest.approx(989.4e12, rel=1e-12)


def test_memory_override_and_case():
    hw = get_hardware("H100", memory_gib=94)
    assert hw.memory_bytes == 94 * 2 ** 30 and hw.bf16_flops == get_hardware("h100").bf16_flops
    with pytest.raises(ForjaError, match="memory_gib"):
        get_hardware("h100", memory_gib=0)


def test_memory_is_what_the_device_reports():
    """An H100 80GB reports 79.2 GiB to torch (81,082-81,090 MiB): the table holds that, so
    `forja plan --gpu h100` and a run on the device (which reads total_memory) agree."""
    assert get_hardware("h100").memory_bytes / 2 ** 30 == pytest.approx(79.2)


def test_an_old_memory_gb_row_says_the_new_name(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text("[h100]\nmemory_gb = 80\n")
    with pytest.raises(ForjaError, match=r"`memory_gb`, which is now `memory_gib`.*79.2"):
        load_hardware(path)


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ForjaError, match=r"unknown hardware kind 'tpu-v9'.*h100.*mi300x"):
        get_hardware("tpu-v9")


def test_user_file_overrides_fields_and_adds_devices(tmp_path, monkeypatch):
    path = write(tmp_path, """
[h100]
inter_node_gbps = 25
[my-gpu]
name = "Mine"
memory_gib = 24
bf16_tflops = 100
fp8_tflops = 0
fp32_tflops = 10
hbm_gbps = 500
intra_node_gbps = 32
inter_node_gbps = 3.125
gpus_per_node = 2
""")
    table = load_hardware(path)
    assert table["h100"].inter_node_bytes_per_s == 25e9
    assert table["h100"].bf16_flops == 989.4e12  # untouched fields keep the packaged figure
    assert "inter_node_gbps" in table["h100"].source and str(path) in table["h100"].source
    assert table["my-gpu"].memory_bytes == 24 * 2 ** 30 and table["my-gpu"].gpus_per_node == 2
    assert "h200" in table
    assert load_hardware()["h100"].inter_node_bytes_per_s == 50e9  # no file, no override
    monkeypatch.setenv(ENV_VAR, str(path))
    assert get_hardware("my-gpu").name == "Mine"


@pytest.mark.parametrize(("text", "match"), [
    ("[h100]\nnvlink = 1\n", r"\[h100\] has unknown field `nvlink`"),
    ("[new]\nname = 'x'\nmemory_gib = 1\n", r"\[new\] is a new device and lacks field `bf16_tflops`"),
    ("[h100]\nmemory_gib = -1\n", r"\[h100\] has a bad value -1 for `memory_gib`"),
    ("[h100]\ngpus_per_node = 2.5\n", r"bad value 2.5 for `gpus_per_node`"),
    ("h100 = 3\n", r"`h100` must be a table"),
    ("[h100\n", "not valid TOML"),
])
def test_bad_user_file_names_device_field_and_fix(tmp_path, text, match):
    with pytest.raises(ForjaError, match=match):
        load_hardware(write(tmp_path, text))


def test_missing_user_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope.toml"))
    with pytest.raises(ForjaError, match="does not exist"):
        load_hardware()


def test_a_device_the_table_lacks_has_its_memory_and_an_unknown_peak():
    hw = hardware_for_device("NVIDIA RTX PRO 6000 Blackwell", 96e9)
    assert hw.kind == "unknown" and not hw.peak_known and hw.memory_bytes == 96e9
    assert hw.bf16_flops == 0 and "unknown peak" in hw.source and ENV_VAR in hw.source
    known = hardware_for_device("NVIDIA H100 80GB HBM3", 85e9)  # a known name keeps its row, with its real memory
    assert known.kind == "h100" and known.memory_bytes == 85e9 and known.peak_known


def test_an_unknown_device_plans_memory_but_predicts_no_speed_and_no_mfu():
    from tests.unit.plan.test_planner import job

    j = job("debug", seq=64, batch=2, gpu=True, bf16=True)
    c = evaluate(j, Layout(), hardware_for_device("Some Future GPU", 24e9))
    assert c.memory.total > 0 and c.fits  # what fits is still told from the device's own memory
    assert c.tokens_per_sec == 0 and math.isnan(c.mfu)
    assert predict_time(j, Layout(), get_hardware("h100")).total > 0


def test_a_user_row_is_found_by_its_device_name(tmp_path):
    path = write(tmp_path, """
[rtx6000]
name = "NVIDIA RTX 6000 Ada Generation"
memory_gib = 48
bf16_tflops = 364
fp8_tflops = 728
fp32_tflops = 91
hbm_gbps = 960
intra_node_gbps = 32
inter_node_gbps = 12.5
gpus_per_node = 4
""")
    hw = hardware_for_device("NVIDIA RTX 6000 Ada Generation", 50e9, path=path)
    assert hw.kind == "rtx6000" and hw.bf16_flops == 364e12 and hw.memory_bytes == 50e9


def test_an_unknown_kind_says_unknown_peak_and_how_to_add_it():
    with pytest.raises(ForjaError, match=r"unknown peak.*FORJA_HARDWARE.*--gpu-memory"):
        get_hardware("rtx-9090")
