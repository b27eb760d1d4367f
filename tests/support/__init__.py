"""The suite's helpers, imported as `from tests.support import gpu_setup` or `from tests.support.train_helpers import ...`
(tests/README.md)."""
