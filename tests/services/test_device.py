

def test_ready_edge_device_profiles_exist_and_order_sensibly() -> None:
    from services.device import builtin_profiles

    p = builtin_profiles()
    for name in ("a100", "rtx4090", "rtx3090", "jetson-agx-orin", "orin-nano", "cpu-only"):
        assert name in p, name
    assert p["a100"].gpu_tflops > p["rtx4090"].gpu_tflops > p["rtx3090"].gpu_tflops
    assert p["jetson-agx-orin"].gpu_tflops > p["orin-nano"].gpu_tflops > p["cpu-only"].gpu_tflops
    assert p["orin-nano"].gpu_mem_gb <= p["orin-nano"].cpu_mem_gb
