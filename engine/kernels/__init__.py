"""Triton kernels for the serving path, each a file with its kernel, a thin launcher and a
PyTorch reference the tests hold it to (tests/kernels/test_<file>.py).

Which kernels run where is policy.py's, how they launch launch.py's; this package's names re-export them.
Triton is optional: `available()` probes it once and logs one line. Kernels also run
under TRITON_INTERPRET=1 on the CPU, where FP8 rounding is done explicitly (the
interpreter's own float->e4m3 cast mis-rounds values near powers of two); on the GPU
the hardware's round-to-nearest-even cast is used.
"""

from engine.kernels.launch import (
                                   FP_FUSION,
                                   PDL_ENV,
                                   WS_HEAD_DIMS,
                                   available,
                                   hopper_feature,
                                   interpreting,
                                   launch_pdl,
                                   pdl_launch,
                                   pdl_runs,
                                   supports_fp8_tensor_cores,
)
from engine.kernels.policy import (
                                   ATTENTION_KERNELS,
                                   FP8_GEMM_ENV,
                                   GEMM_MODES,
                                   TRITON_PLAIN_LINEARS,
                                   attention_kernel,
                                   attention_option_names,
                                   block_gemm_kernels,
                                   check_attention_kernel,
                                   default_gemm_kernels,
                                   hopper_gemm_kernels,
                                   make_attention,
                                   triton_fp8_gemm_runs,
                                   warp_specialized_attention_runs,
)

__all__ = ["ATTENTION_KERNELS", "FP8_GEMM_ENV", "FP_FUSION", "GEMM_MODES", "PDL_ENV", "TRITON_PLAIN_LINEARS",
           "WS_HEAD_DIMS", "attention_kernel", "attention_option_names", "available", "block_gemm_kernels",
           "check_attention_kernel", "default_gemm_kernels", "hopper_feature", "hopper_gemm_kernels", "interpreting",
           "launch_pdl", "make_attention", "pdl_launch", "pdl_runs", "supports_fp8_tensor_cores",
           "triton_fp8_gemm_runs", "warp_specialized_attention_runs"]
