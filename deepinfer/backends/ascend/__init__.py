"""The Ascend NPU backend (torch_npu); registered by plugin.py, imported only when selected."""
