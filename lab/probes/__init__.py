"""One-off probes on a GPU: other libraries' FP8 attention and GEMMs (cuDNN, FA3, cuBLASLt), kernel
configurations, the step's profile, and Nsight Compute summaries. Each prints one JSON object."""
