"""kvharbor's own CPU kernels (csrc/cpu_kernels.c, built on the machine that runs them): their
loader (cpu_kernels), the linears that use them (cpu_linear) and a layer's pointwise ops
(layer_ops)."""
