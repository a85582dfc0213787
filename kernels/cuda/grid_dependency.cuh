// Programmatic dependent launch (PTX ISA "griddepcontrol"; CUDA programming guide, "Programmatic
// Dependent Launch and Synchronization"), for kernels launched with
// cudaLaunchAttributeProgrammaticStreamSerialization: such a kernel may begin while the kernel
// before it on the stream drains, so it must call GridDependencyWait before it reads or writes
// any global memory that kernel (or any earlier one) touches. Without the attribute both calls
// return at once. Inside a CUDA graph the attribute becomes a programmatic edge.
#pragma once

namespace pdserve::kernels::cuda {

// Blocks until every grid this one depends on has completed and its memory is visible.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Lets the next kernel on the stream (launched with programmatic serialization) start its blocks
// as soon as every block of this grid has called this or exited; that kernel still waits in
// GridDependencyWait for this grid's completion, so this is safe anywhere in a kernel.
__device__ __forceinline__ void GridDependencyLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
}

}  // namespace pdserve::kernels::cuda
