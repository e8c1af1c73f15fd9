"""Linear layers' weight formats: the interface (`base.py`), dense, int4 (AWQ, W4A16) and FP8
methods, the checkpoint's `quantization_config` (`config.py`) and which layer takes which (`select.py`)."""
