# The vendored files are libraries of test mixins, not test modules of their own: never collect them.
collect_ignore_glob = ["*.py", "*/*.py"]

# Markers the transformers test mixins put on their tests (registered in transformers' own pyproject.toml).
MARKERS = (
    "generate: generation tests",
    "torch_compile_test: torch.compile tests",
    "torch_export_test: torch.export tests",
    "onnx_export_test: ONNX export tests",
    "executorch_export_test: ExecuTorch export tests",
    "flash_attn_test: flash attention tests",
    "flash_attn_3_test: flash attention 3 tests",
    "flash_attn_4_test: flash attention 4 tests",
    "accelerate_tests: accelerate tests",
)


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
