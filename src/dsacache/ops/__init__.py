"""GPU ops on the packed cache. Each op folder holds ``naive.py`` (the PyTorch reference,
also the CPU path) beside its Triton kernels, and exports one public function per step."""
