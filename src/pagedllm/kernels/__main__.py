"""`python -m pagedllm.kernels`: build the C++ CPU kernels now (make setup runs this)."""

import sys

from pagedllm.kernels import KernelUnavailable, build_directory, cpu_ops

try:
    cpu_ops()
except KernelUnavailable as e:
    print(f"warning: {e}\npagedllm will use the SDPA attention backend instead.", file=sys.stderr)
    sys.exit(0)
print(f"C++ CPU kernels ready in {build_directory()}")
