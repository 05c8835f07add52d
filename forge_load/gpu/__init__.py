"""The GPU edge: NVML (the Probe on a real GPU), the CUDA launcher and its kernels, the simulated GPU, and the
backend that chooses between them."""
