

def test_ready_edge_device_profiles_exist_and_order_sensibly() -> None:
    from services.device import builtin_profiles

    p = builtin_profiles()
    for name in ("a100", "rtx4090", "rtx3090", "jetson-agx-orin", "orin-nano", "cpu-only"):
        assert name in p, name
    assert p["a100"].gpu_tflops > p["rtx4090"].gpu_tflops > p["rtx3090"].gpu_tflops
    assert p["jetson-agx-orin"].gpu_tflops > p["orin-nano"].gpu_tflops > p["cpu-only"].gpu_tflops
    assert p["orin-nano"].gpu_mem_gb <= p["orin-nano"].cpu_mem_gb


def test_every_ready_profile_but_tiny_edge_has_a_memory_bandwidth_at_a_sane_balance() -> None:
    from services.device import PAPER_FLOP_PER_BYTE, builtin_profiles

    p = builtin_profiles()
    assert p["tiny-edge"].mem_gbps is None  # the tests' FLOPs-only reference device
    for name, prof in p.items():
        if name == "tiny-edge":
            continue
        balance = prof.gpu_tflops * 1e3 / prof.mem_gbps  # FLOP per byte
        assert 5 <= balance <= 150, (name, balance)
    for size in ("s", "m", "l", "xl"):
        prof = p[f"hetroute-{size}"]
        assert prof.gpu_tflops * 1e3 / prof.mem_gbps == PAPER_FLOP_PER_BYTE
    assert p["a100"].mem_gbps > p["rtx4090"].mem_gbps > p["jetson-agx-orin"].mem_gbps
    assert p["jetson-agx-orin"].mem_gbps > p["orin-nano"].mem_gbps


def test_memory_bandwidth_is_parsed_strictly(tmp_path) -> None:
    import pytest

    from services.device import DeviceProfile, load_profile

    base = {"gpu_tflops": 10, "gpu_mem_gb": 8, "cpu_mem_gb": 32, "h2d_gbps": 16}
    assert DeviceProfile.from_json(base).mem_gbps is None
    assert DeviceProfile.from_json({**base, "mem_gbps": None}).mem_gbps is None
    assert DeviceProfile.from_json({**base, "mem_gbps": 300}).mem_gbps == 300.0
    for bad in (0, -5, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="mem_gbps must be"):
            DeviceProfile.from_json({**base, "mem_gbps": bad})
    with pytest.raises(ValueError, match=r"unknown device profile field.*'mem_gbs'"):
        DeviceProfile.from_json({**base, "mem_gbs": 300})
    f = tmp_path / "dev.yaml"
    f.write_text("name: mine\ngpu_tflops: 10\ngpu_mem_gb: 8\ncpu_mem_gb: 32\nh2d_gbps: 16\n"
                 "mem_gbps: 300\n")
    prof = load_profile(f)
    assert prof.mem_gbps == 300.0
    fields = {k: v for k, v in prof.to_json().items() if k != "name"}
    assert DeviceProfile.from_json(fields, name="mine") == prof  # to_json carries it
